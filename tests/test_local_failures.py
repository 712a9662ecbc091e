"""An error one rank meets on its own — a wrong ``out``, a sum its quantizer cannot carry, a peer's
payload it cannot decode — or that every rank meets while encoding, ends the call on every rank
with an error, none left waiting; what the ranks must hold alike (the session's payload capacity)
stays alike, so the next call works. A reducer closed mid-step ends its calls' futures. Sizes a
peer announces past what the call can hold are refused before anything is allocated for them."""

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transport.allgather as allgather
import sparsecomm.transport.collectives as collectives
from sparsecomm.launch import run_local
from sparsecomm.pipeline import Segment
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.allgather import AllgatherTransport, FusedCall
from sparsecomm.transport.request import Request
from sparsecomm.transport.session import TransportSession
from sparsecomm.transport.sparse_allreduce import SparseAllreduce

HANG_S = 60  # a rank left waiting fails the test here instead of hanging it
N = 4096


def gradient(rank: int, k: int = 10) -> SparseGradient:
    indices = (torch.arange(k) * 7 % N).sort().values
    return SparseGradient(indices, torch.arange(1.0, k + 1) * (rank + 1), torch.Size([N]))


def outcome(call) -> str:
    try:
        return f"ok {float(call().total.sum()):g}"
    except sc.SparseCommError as err:
        return f"{type(err).__name__}: {err}"


def with_a_short_out(rank: int, world: int, transport: str) -> tuple[str, str, int | None]:
    """Rank 0 passes an ``out`` one entry short; then a valid call follows."""
    session = TransportSession() if transport != "allgather, no session" else None
    out = torch.zeros(N - 1) if rank == 0 else None

    def call(number: int, wrong: torch.Tensor | None):
        request = Request(key="w", call=number)
        if transport in ("auto", "dense", "sketch_allreduce"):
            other = sc.parse_spec(transport).transport
            return lambda: other.reduce(gradient(rank), None, request, wrong, session)
        if transport == "sparse_allreduce":
            return lambda: SparseAllreduce(algorithm="ssar_sa").reduce(gradient(rank), None, request, wrong, session)
        if transport == "fused":
            calls = [FusedCall(gradient(rank), Request(key=f"w{i}", call=number), wrong if i else None)
                     for i in range(2)]
            return lambda: AllgatherTransport().reduce_fused(calls, None, session)[1]
        return lambda: AllgatherTransport().reduce(gradient(rank), None, request, wrong, session)

    first, second = outcome(call(0, out)), outcome(call(1, None))
    return first, second, session.payload_capacity if session is not None else None


@pytest.mark.parametrize("transport", ["allgather", "allgather, no session", "fused", "sparse_allreduce", "auto",
                                       "dense", "sketch_allreduce"])
def test_one_ranks_wrong_out_makes_every_rank_raise_and_the_next_call_works(transport):
    (short, after_short, capacity_0), (other, after_other, capacity_1) = run_local(
        2, with_a_short_out, transport, timeout=HANG_S)
    assert "out has 4095" in short, short
    assert "could not make its part of" in other and "out has" not in other, other
    assert after_short == after_other and after_short.startswith("ok"), (after_short, after_other)
    if transport != "sketch_allreduce":  # a sketch this small collides: alike on every rank, not exact
        assert after_short == f"ok {float(3 * torch.arange(1.0, 11).sum()):g}"
    assert capacity_0 == capacity_1


def with_a_corrupt_payload(rank: int, world: int) -> tuple[str, int, str]:
    """Rank 0 sends a payload whose magic is wrong: its peer cannot decode it, rank 0 never decodes
    its own (lossless codecs); the session's next capacity must still be the same on both."""
    session = TransportSession()
    if rank == 0:
        real = allgather.payload_of

        def corrupt(sparse, group, request):
            payload = real(sparse, group, request).clone()
            payload[0] ^= 0xFF
            return payload

        allgather.payload_of = corrupt
    try:
        first = outcome(lambda: AllgatherTransport().reduce(gradient(rank, 200), None, Request(key="w"), None,
                                                            session))
    finally:
        if rank == 0:
            allgather.payload_of = real
    capacity = session.payload_capacity
    # a payload that fits the grown capacity only: on capacities that differ, gloo would abort
    second = outcome(lambda: AllgatherTransport().reduce(gradient(rank, 300), None, Request(key="w", call=1),
                                                         None, session))
    return first, capacity, second


def test_a_payload_only_its_receivers_cannot_decode_leaves_the_capacity_agreed():
    (sender, capacity_0, next_0), (receiver, capacity_1, next_1) = run_local(2, with_a_corrupt_payload,
                                                                             timeout=HANG_S)
    assert sender.startswith("ok") and "PayloadError" in receiver, (sender, receiver)
    assert capacity_0 == capacity_1
    assert next_0 == next_1 == f"ok {float(3 * torch.arange(1.0, 301).sum()):g}"


def quantizing_an_overflowing_sum(rank: int, world: int) -> str:
    """Both ranks' gradients are finite; rank 0 owns [0, 4), whose sum's norm is past float32's range."""
    grad = (SparseGradient(torch.tensor([0, 1]), torch.tensor([3e38, 3e38]), torch.Size([8])) if rank == 0
            else SparseGradient(torch.tensor([6]), torch.tensor([1.0]), torch.Size([8])))
    return outcome(lambda: SparseAllreduce(algorithm="dsar_sa", qsgd_bits=4).reduce(grad, None, Request(key="w")))


def test_a_range_its_owner_cannot_quantize_makes_every_rank_raise():
    owner, other = run_local(2, quantizing_an_overflowing_sum, timeout=HANG_S)
    assert "rank 0 could not quantize its range of the sum of 'w'" in owner and "overflows" in owner, owner
    assert "rank 0 could not quantize its range of the sum of 'w'" in other and "overflows" not in other, other


def fusing_two_calls_with_side_numbers(rank: int, world: int) -> str:
    calls = [FusedCall(gradient(rank), Request(key=f"w{i}", side=(1.0,))) for i in range(2)]
    return outcome(lambda: AllgatherTransport().reduce_fused(calls, None, TransportSession())[0])


def test_an_error_every_rank_meets_while_encoding_a_fused_exchange_raises_on_every_rank():
    for result in run_local(2, fusing_two_calls_with_side_numbers, timeout=HANG_S):
        assert "at most one call of a fused exchange may carry side numbers" in result, result


def closing_mid_step(rank: int, world: int) -> str:
    reducer = sc.GradientReducer("topk(ratio=0.5)+residual+rice+fp32+allgather")
    future = reducer.reduce_flat_async("bucket", torch.arange(1.0, 9.0), (Segment("w", 0, 8),), last=False)
    reducer.close()
    assert future.done()
    try:
        future.wait()
    except sc.SparseCommError as err:
        return str(err)
    return "no error"


def test_a_reducer_closed_before_its_step_finished_ends_the_steps_calls():
    for result in run_local(2, closing_mid_step, timeout=HANG_S):
        assert "closed before the step's calls finished" in result, result


BIG = 1 << 30


def announcing(rank: int, world: int, how: str) -> tuple[str, list[int]]:
    """Rank 1 announces a message of 1 GiB for an 8-entry call; what rank 0 makes of it, and the
    buffers of 1 GiB or more it allocated."""
    allocated: list[int] = []
    real_empty = torch.empty

    def watched(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        if tensor.numel() >= BIG:
            allocated.append(tensor.numel())
        return tensor

    limit = collectives.message_limit(8)
    if how == "agreement" and rank == 1:
        real_agree = allgather.agree
        allgather.agree = lambda group, request, numel, config, nnz=0, nbytes=0: real_agree(
            group, request, numel, config, nnz, BIG)
    torch.empty = watched
    try:
        if how == "agreement":
            result = outcome(lambda: AllgatherTransport().reduce(gradient(rank), None, Request(key="w")))
        elif rank == 1:  # only the size: rank 0 refuses it before the data would go
            collectives._sendrecv(torch.tensor([BIG]), torch.empty(1, dtype=torch.int64), 0, None)
            result = "lied"
        else:
            try:
                collectives.exchange_bytes(torch.zeros(4, dtype=torch.uint8), 1, None, limit)
                result = "accepted"
            except sc.PayloadError as err:
                result = str(err)
    finally:
        torch.empty = real_empty
    return result, allocated


def test_a_two_round_allgather_refuses_an_announced_size_no_codec_makes_on_every_rank():
    for result, allocated in run_local(2, announcing, "agreement", timeout=HANG_S):
        assert "announced a payload of 1073741824 bytes" in result and not allocated, (result, allocated)


def test_a_peers_announced_size_past_the_calls_limit_is_refused_before_allocation():
    (refused, allocated), _ = run_local(2, announcing, "exchange", timeout=HANG_S)
    assert "announced a message of 1073741824 bytes" in refused and not allocated, (refused, allocated)


class Work:
    """A transfer's work whose wait fails or not."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.waited = fails, False

    def wait(self) -> None:
        self.waited = True
        if self.fails:
            raise RuntimeError("the peer went away")


def test_closing_transfers_waits_for_every_one_even_after_one_failed():
    arrivals = object.__new__(collectives.Arrivals)  # no process group: the works alone
    works = [Work(fails=True), Work(fails=False), Work(fails=True)]
    arrivals._receive_works, arrivals._send_works = {1: works[0]}, works[1:]
    with pytest.raises(RuntimeError, match="the peer went away"):
        arrivals.close()
    assert all(work.waited for work in works)
