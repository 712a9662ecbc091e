"""Waiting for a collective by polling it (`sparsecomm.transport.waiting`): the waiter gets the same
result or error as ``wait`` would give, keeps handing the processor to other threads while the work
is pending, sleeps once the polling limit is past, and leaves a device's work to ``wait``. Polling
relies on gloo's collectives completing on gloo's own threads, untouched by the waiter: checked
too."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from sparsecomm.launch import run_local
from sparsecomm.transport import waiting


class CountedYields:
    """Stands in for the processor hand-off and counts it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        time.sleep(0)


@pytest.fixture
def yields(monkeypatch: pytest.MonkeyPatch) -> CountedYields:
    counted = CountedYields()
    monkeypatch.setattr(waiting, "_yield_processor", counted)
    return counted


def completed_later(delay_s: float, value: object = None, error: Exception | None = None) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()

    def complete() -> None:
        time.sleep(delay_s)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    threading.Thread(target=complete, daemon=True).start()
    return future


def test_a_pending_future_is_polled_and_its_value_returned(yields):
    assert waiting.wait_polling(completed_later(0.005, value=7)) == 7
    assert yields.calls > 0


def test_a_finished_future_returns_at_once_without_polling(yields):
    future: torch.futures.Future = torch.futures.Future()
    future.set_result("done")
    assert waiting.wait_polling(future) == "done"
    assert yields.calls == 0


def test_the_error_of_a_failed_future_reaches_the_waiter(yields):
    with pytest.raises(ValueError, match="peer failed"):
        waiting.wait_polling(completed_later(0.005, error=ValueError("peer failed")))


def test_past_the_limit_the_waiter_sleeps_until_the_work_is_done(yields):
    started = time.perf_counter()
    assert waiting.wait_polling(completed_later(0.05, value="late"), limit_s=0.005) == "late"
    assert time.perf_counter() - started >= 0.05
    # polling stopped at the limit: far fewer hand-offs than 50 ms of polling would make
    polled_only_the_limit = yields.calls
    assert waiting.wait_polling(completed_later(0.05, value="late"), limit_s=0.04) == "late"
    assert yields.calls - polled_only_the_limit > polled_only_the_limit


class PendingWork:
    """A device's work as the waiter sees it: never completed on the processor, done once waited for."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_devices_work_is_waited_for_not_polled(yields):
    work = PendingWork()
    waiting.wait_for(work, torch.device("cuda"))  # type: ignore[arg-type]
    assert work.waited and yields.calls == 0


def test_the_transports_worker_thread_waits_without_polling(yields):
    """Its waits overlap the backward pass, which needs the processor and the interpreter."""
    on_worker, on_caller = PendingWork(), PendingWork()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=waiting.WORKER_THREAD_PREFIX) as worker:
        worker.submit(waiting.wait_for, on_worker, torch.device("cpu")).result()
    assert on_worker.waited and yields.calls == 0
    waiting.wait_for(on_caller, torch.device("cpu"))  # type: ignore[arg-type]
    assert on_caller.waited and yields.calls > 0


def summed_by_polling(rank: int, world: int) -> list[float]:
    sums = []
    for step in range(20):
        tensor = torch.full((4096,), float(rank + step))
        work = dist.all_reduce(tensor, async_op=True)
        if step % 2:  # c10d's future of the work, as the reducer waits for a dense step's sum
            sums.append(float(waiting.wait_polling(work.get_future())[0][0]))
        else:
            waiting.wait_for(work, tensor.device)
            sums.append(float(tensor[0]))
    return sums


def test_gloo_sums_waited_for_by_polling_their_works_or_futures_are_complete():
    for world in (2, 3):
        expected = [sum(rank + step for rank in range(world)) for step in range(20)]
        assert run_local(world, summed_by_polling) == [expected] * world


def completes_unwaited(rank: int, world: int) -> bool:
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    deadline = time.perf_counter() + 10.0
    while not work.is_completed() and time.perf_counter() < deadline:
        time.sleep(0.001)
    completed = work.is_completed()
    work.wait()
    return completed


def test_a_gloo_collective_completes_without_being_waited_for():
    assert run_local(2, completes_unwaited) == [True, True]
