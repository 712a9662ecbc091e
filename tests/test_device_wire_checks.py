"""The device route's checks of what the ranks gathered: ranks whose buckets are laid out apart, or
that resumed from different steps, raise on every rank at the bucket's first call (their wires
could differ in length, and gloo aborts the process on such a gather); a rank at another step
later is refused by its wire's header; and a buffer whose indices fall outside the tensor, or whose
unused slots carry values, is refused on every rank rather than summed into the wrong entries. And
a half-precision gradient's entries sent whole keep their codec's error in fp32."""

import pytest
import torch

import sparsecomm as sc
from sparsecomm.device import wire
from sparsecomm.device.whole import WholeError
from sparsecomm.launch import run_local
from sparsecomm.pipeline import Segment

HANG_S = 60


def reduce_once(rank: int, world: int, spec: str, segments: tuple[Segment, ...], gradient: torch.Tensor) -> str:
    reducer = sc.GradientReducer(spec, seed=0)
    try:
        future = reducer.reduce_flat_async("bucket", gradient, segments, last=True)
        reducer.finish_step()
        total = future.wait()
        return "ok " + " ".join(f"{i}:{float(total[i]):g}" for i in total.nonzero().view(-1).tolist())
    except sc.SparseCommError as err:
        return str(err)
    finally:
        reducer.close()


def laid_out_apart(rank: int, world: int) -> str:
    segments = (Segment("a", 0, 150), Segment("b", 150, 50)) if rank == 0 else (Segment("a", 0, 200),)
    gradient = torch.randn(200, generator=torch.Generator().manual_seed(rank))
    return reduce_once(rank, world, "dgc(ratio=0.01)+raw+fp32+allgather", segments, gradient)


def test_ranks_that_lay_a_bucket_out_apart_raise_at_its_first_call():
    for outcome in run_local(2, laid_out_apart, timeout=HANG_S):
        assert "the ranks' buckets differ in 'bucket'" in outcome, outcome


def one_rank_writes(rank: int, world: int, slot: int | None, word: int, value_word: int | None, spec: str) -> str:
    """Rank 1 overwrites one index word of its wire (at ``slot``; None: none) after packing it, and
    with ``value_word`` the value word of that slot too."""
    if rank == 1 and slot is not None:
        pack = wire.WireFormat.pack

        def written(self, out, *args, **kwargs):
            delivered = pack(self, out, *args, **kwargs)
            out[wire.HEADER + slot] = word
            if value_word is not None:
                out[wire.HEADER + self.index_words + slot] = value_word
            return delivered

        wire.WireFormat.pack = written
    gradient = torch.zeros(100)
    gradient[10 + rank] = 7.0
    try:
        return reduce_once(rank, world, spec, (Segment("w", 0, 100),), gradient)
    finally:
        if rank == 1 and slot is not None:
            wire.WireFormat.pack = pack


@pytest.mark.parametrize(("slot", "word", "value_word"), [
    (0, 1000, None), (0, -7, None), (0, 2**31 - 1, None),
    (4, 100, 0x3F800000),  # an unused slot (the padding entry, 100) carrying 1.0
], ids=["past the end", "negative", "largest", "unused slot with a value"])
def test_a_raw_buffer_naming_entries_outside_the_tensor_is_refused_on_every_rank(slot, word, value_word):
    honest = run_local(2, one_rank_writes, None, 0, None, "dgc(ratio=0.05)+raw+fp32+allgather", timeout=HANG_S)
    assert honest == ["ok 10:3.5 11:3.5"] * 2, honest
    for outcome in run_local(2, one_rank_writes, slot, word, value_word, "dgc(ratio=0.05)+raw+fp32+allgather",
                             timeout=HANG_S):
        assert "is not one of this layout" in outcome, outcome


def test_the_entries_sent_whole_take_back_their_codecs_error_in_fp32():
    """A bf16 gradient's entries sent whole, plus the fp32 error the codec left on them: added in
    bf16, an error below the entry's rounding step would vanish every step."""
    error = WholeError(torch.tensor([0, 2]), torch.tensor([1e-4, -1e-4]), torch.zeros(2), ([], []))
    sent = error.sent(torch.tensor([1.0, 5.0, 2.0], dtype=torch.bfloat16))
    assert sent.dtype == torch.float32
    assert torch.equal(sent, torch.tensor([1.0, 2.0]) + torch.tensor([1e-4, -1e-4]))


def resumed_apart(rank: int, world: int, spec: str) -> str:
    """Each rank resumes from its own step's checkpoint: rank 0 from step 2, rank 1 from step 3."""
    segments = (Segment("w", 0, 300),)

    def step(reducer: sc.GradientReducer, number: int) -> None:
        gradient = torch.randn(300, generator=torch.Generator().manual_seed(100 * rank + number))
        future = reducer.reduce_flat_async("bucket", gradient, segments, last=True)
        reducer.finish_step()
        future.wait()

    reducer = sc.GradientReducer(spec, seed=0)
    saved = []
    for number in range(3):
        step(reducer, number)
        saved.append(reducer.state_dict())
    reducer.close()
    resumed = sc.GradientReducer(spec, seed=0)
    resumed.load_state_dict(saved[1] if rank == 0 else saved[2])
    try:
        step(resumed, 10)
        return "no error"
    except sc.SparseCommError as err:
        return str(err)
    finally:
        resumed.close()


@pytest.mark.parametrize("spec", ["dgc(ratio=0.01)+residual+packed+fp32+allgather",
                                  # the warm-up's density follows the step, and with it the wire's length
                                  "dgc(ratio=0.01,warmup=4)+residual+packed+fp32+allgather"])
def test_ranks_resumed_from_different_steps_raise_on_every_rank(spec):
    for outcome in run_local(2, resumed_apart, spec, timeout=HANG_S):
        assert "the ranks are at different steps of 'bucket' (steps 2 to 3)" in outcome, outcome


def drifts_a_step(rank: int, world: int) -> list[str]:
    """Rank 1's stream counts one step more after the first call, its buffers kept: the header its
    wire carries tells."""
    reducer = sc.GradientReducer("dgc(ratio=0.05)+residual+packed+fp32+allgather", seed=0)
    segments = (Segment("w", 0, 100),)
    outcomes = []
    try:
        for number in range(2):
            if number == 1 and rank == 1:
                reducer.pipeline.states["w"].step += 1
            try:
                future = reducer.reduce_flat_async("bucket", torch.ones(100), segments, last=True)
                reducer.finish_step()
                future.wait()
                outcomes.append("ok")
            except sc.SparseCommError as err:
                outcomes.append(str(err))
        return outcomes
    finally:
        reducer.close()


def test_a_rank_at_another_step_is_refused_by_its_wires_header():
    for outcomes in run_local(2, drifts_a_step, timeout=HANG_S):
        assert outcomes[0] == "ok" and "at different steps of it" in outcomes[1], outcomes
