"""`sparsecomm.bench.op_counts`: which of the profiler's trace events are copies between host and
device, and their bytes, and which threads' syncs count (the counting of ops and syncs is exercised
by the benches' and paths' tests)."""

import threading

import pytest
import torch

from sparsecomm.bench.op_counts import count_ops, host_device_bytes


def copy(name: str, nbytes: int | None, category: str = "gpu_memcpy") -> dict:
    """A trace event as torch's profiler wrote it on an H200 (torch 2.11, CUDA 13)."""
    args = {"device": 0, "context": 1, "stream": 7, "correlation": 7}
    if nbytes is not None:
        args |= {"bytes": nbytes, "memory bandwidth (GB/s)": 50.2}
    return {"ph": "X", "cat": category, "name": name, "args": args}


@pytest.mark.parametrize(("event", "expected"), [
    (copy("Memcpy HtoD (Pageable -> Device)", 4096), 4096),
    (copy("Memcpy DtoH (Device -> Pinned)", 512), 512),
    (copy("Memcpy DtoD (Device -> Device)", 4096), 0),  # stays on the device
    (copy("Memset (Device)", 4096, "gpu_memset"), 0),
    (copy("cudaMemcpyAsync", None, "cuda_runtime"), 0),  # the host's call that queued the copy
    (copy("Memcpy HtoD (Pinned -> Device)", None), 0),  # no bytes recorded
])
def test_only_a_devices_copies_from_and_to_the_host_count(event, expected):
    assert host_device_bytes([event]) == expected


def test_a_traces_copies_add_up():
    events = [copy("Memcpy DtoH (Device -> Pinned)", 1 << 20), copy("cudaMemcpyAsync", None, "cuda_runtime"),
              copy("Memcpy HtoD (Pinned -> Device)", 1 << 20), copy("Memcpy DtoD (Device -> Device)", 1 << 20),
              {"ph": "X", "cat": "cpu_op", "name": "aten::copy_"}]
    assert host_device_bytes(events) == 2 << 20


def test_a_step_on_the_host_copies_nothing_between_host_and_device():
    values = torch.ones(1000)
    counted = count_ops(lambda: values.clone().cpu(), 2)
    assert counted.host_device_bytes == 0 and counted.ops >= 1


def test_a_sync_in_a_callback_that_another_thread_runs_counts():
    """A collective's future runs its callbacks on the thread that finishes it (gloo's), not the
    caller's: a step whose completion reads a scalar there still reads the host once."""
    values = torch.ones(3)

    def step() -> None:
        finished = torch.futures.Future()
        read = finished.then(lambda _: values.sum().item())
        worker = threading.Thread(target=finished.set_result, args=(None,))
        worker.start()
        worker.join()
        read.wait()

    assert count_ops(step, 2).syncs == 1
