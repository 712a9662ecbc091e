"""A custom loop's step, checked on every rank: a problem one rank finds with its own input (a
missing gradient, a repeated name, a gradient sent sparse here and dense there, a `state` built
otherwise, another optimizer) makes every rank raise at the step's agreement, this rank with its
reason, and the next step goes on; a step refused for a rank's NaN leaves the ranks at one step,
and a finite rank's gradient in its feedback."""

import math

import pytest
import torch

import sparsecomm as sc
from helpers import outcome
from sparsecomm.launch import run_local
from sparsecomm.pipeline import Segment

HANG_S = 60
SPEC = "topk(ratio=0.05)+residual+rice+fp32"


def one_rank_passes(rank: int, world: int, case: str) -> list[str]:
    """Rank 1's pairs are wrong by ``case``; then a good step."""
    outcomes = []
    with sc.GradientReducer(SPEC) as reducer:
        pairs = [("a", torch.ones(3)), ("w", torch.ones(20, 20))]
        if rank == 1:
            pairs = {"none": [("a", torch.ones(3)), ("w", None)],
                     "repeat": [("a", torch.ones(3)), ("a", torch.ones(3)), ("w", torch.ones(20, 20))],
                     "integer": [("a", torch.ones(3)), ("w", torch.ones(20, 20, dtype=torch.int64))],
                     "expanded": [("a", torch.ones(3)), ("w", torch.ones(20, 1).expand(20, 20))],
                     "sparse": [("a", torch.ones(3)), ("w", torch.ones(20, 20).to_sparse())]}[case]
        for step_pairs in (pairs, [("a", torch.ones(3)), ("w", torch.ones(20, 20))]):
            outcomes.append(outcome(reducer.allreduce_, step_pairs))
    return outcomes


@pytest.mark.parametrize(("case", "reason"), [("none", "has no gradient"), ("repeat", "names repeat"),
                                               ("integer", "floating point"), ("expanded", "is expanded"),
                                               ("sparse", None)])
def test_a_problem_with_one_ranks_gradients_is_raised_on_every_rank(case, reason):
    first, second = run_local(2, one_rank_passes, case, timeout=HANG_S)
    assert first[1] == second[1] == "ok"  # the next step goes on
    if reason is None:  # the same name, dense on one rank and sparse on the other
        assert "ranks disagree" in first[0] and "ranks disagree" in second[0], (first, second)
    else:
        assert reason in second[0], second
        assert "could not make its part of 'gradients a, w'" in first[0] or "different tensors" in first[0], first


def mismatched_state(rank: int, world: int) -> str:
    weight = torch.ones(50, 50)
    state = sc.allreduce_gradients([("w", weight)], SPEC)
    try:
        return outcome(sc.allreduce_gradients, [("w", weight)], "dgc" if rank == 1 else SPEC, state)
    finally:
        state.close()


def test_a_state_built_otherwise_on_one_rank_is_refused_on_every_rank():
    first, second = run_local(2, mismatched_state, timeout=HANG_S)
    assert "could not make its part of 'gradients w'" in first, first
    assert "the state passed is a reducer for" in second, second


def other_optimizers(rank: int, world: int) -> list[str]:
    model = torch.nn.Linear(64, 64)
    outcomes = []
    with sc.GradientReducer("dgc", model=model) as reducer:
        reducer.allreduce_([("w", torch.ones(64, 64))])  # started
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if rank == 0 else 0.0)
        outcomes.append(outcome(sc.check_optimizer, optimizer, reducer, done="suited"))
        reducer.allreduce_([("w", torch.ones(64, 64))])
        outcomes.append(str(reducer.spec))
    return outcomes


def test_ranks_given_other_optimizers_are_refused_together_and_keep_their_pipeline():
    first, second = run_local(2, other_optimizers, timeout=HANG_S)
    for outcomes in (first, second):
        assert "GradientReducer.suit_optimizer" in outcomes[0] or "already reduced" in outcomes[0], outcomes
    assert first[1] == second[1]  # one pipeline on every rank


def laid_out(rank: int, world: int, segments: tuple[Segment, ...]) -> str:
    with sc.GradientReducer(SPEC) as reducer:
        return outcome(reducer.reduce_flat_async, "bucket", torch.ones(100), segments, True, done="posted")


@pytest.mark.parametrize(("segments", "says"), [
    ((Segment("a", 0, 50), Segment("a", 50, 50)), "its name repeats"),
    ((Segment("a", 0, 40), Segment("b", 50, 50)), "does not follow"),
    ((Segment("a", 0, 50), Segment("b", 50, 80)), "cover 130 entries of a buffer of 100"),
])
def test_segments_that_do_not_lay_out_the_buffer_are_refused(segments, says):
    for said in run_local(2, laid_out, segments, timeout=HANG_S):
        assert says in said, said


def refused_for_a_nan(rank: int, world: int) -> tuple[int, float, float]:
    with sc.GradientReducer(SPEC) as reducer:
        generator = torch.Generator().manual_seed(rank)
        reducer.allreduce_([("w", torch.randn(100, 100, generator=generator))])
        before = reducer.pipeline.states["w"].feedback["residual"].clone()
        gradient = torch.randn(100, 100, generator=generator)
        if rank == 1:
            gradient[0, 0] = float("nan")
        with pytest.raises(sc.SparseCommError, match="non-finite"):
            reducer.allreduce_([("w", gradient.clone())])
        state = reducer.pipeline.states["w"]
        kept = state.feedback["residual"] - before
        expected = gradient if rank == 0 else torch.zeros_like(gradient)
        return state.step, float((kept - expected).abs().max()), float(expected.abs().max())


def test_a_step_refused_for_one_ranks_nan_keeps_the_ranks_at_one_step_and_the_finite_gradient():
    (first_step, first_error, scale), (second_step, second_error, _) = run_local(2, refused_for_a_nan, timeout=HANG_S)
    assert first_step == second_step == 1
    assert first_error <= 1e-5 * scale and second_error == 0.0


def reduces_one_that_requires_grad(rank: int, world: int) -> list[float]:
    """`reduce` returns the average; a tensor that requires grad on one rank is not written in place."""
    with sc.GradientReducer("topk(ratio=1.0)+residual+raw+fp32") as reducer:
        tensor = torch.full((50, 50), float(rank + 1), requires_grad=rank == 0)
        return reducer.reduce("x", tensor).reshape(-1)[:2].tolist()


def test_reduce_of_a_tensor_that_requires_grad_on_one_rank_returns_the_average_on_every_rank():
    assert run_local(2, reduces_one_that_requires_grad, timeout=HANG_S) == [[1.5, 1.5]] * 2


ADAPTIVE_SPEC = "adaptive(low_rank=2)+residual+rice+int8+allgather"
"""``adaptive`` under error feedback: dense steps and low-rank steps flush residuals into their wire"""


def adaptive_refused_for_a_nan(rank: int, world: int, mode: str) -> tuple[list[int], float, float]:
    """A sparse step (the residual then holds what it did not send), a ``mode`` step refused for
    rank 1's NaN, a sparse step, then two on the device route (which check the ranks' steps)."""
    from sparsecomm.adaptive.config import Mode, Plan

    fed = torch.zeros(300, 200, dtype=torch.float64)
    delivered = torch.zeros_like(fed)
    steps, conserved = [], math.nan
    with sc.GradientReducer(ADAPTIVE_SPEC) as reducer:
        for index, planned in enumerate((Mode.SPARSE, Mode(mode), Mode.SPARSE, Mode.DEVICE, Mode.DEVICE)):
            reducer.adaptive.planner.plan = lambda planned=planned: Plan(planned, 0.01)
            gradient = torch.randn(300, 200, generator=torch.Generator().manual_seed(index)) * (rank == 0)
            if index == 1 and rank == 1:
                gradient[3, 4] = float("nan")
            sent = gradient.clone()
            try:
                reducer.allreduce_([("w", sent)])
                delivered += sent.double() * world
            except sc.SparseCommError:
                assert index == 1
            fed += gradient.nan_to_num().double()
            steps.append(reducer.pipeline.states["w"].step)
            if index == 2:
                held = reducer.pipeline.states["w"].feedback["residual"].double().view_as(fed)
                conserved = float((fed - delivered - held).abs().max())
    return steps, conserved, float(fed.abs().max())


@pytest.mark.parametrize("mode", ["fp32", "fp16", "low rank", "device"])
def test_a_step_refused_for_one_ranks_nan_keeps_the_ranks_at_one_step_and_the_gradient(mode):
    """Every rank raises; the finite rank keeps in its feedback what it sent (its residual and this
    step's gradient) and its step count, so the device route's later steps find the ranks alike."""
    (steps, conserved, scale), (other_steps, _, _) = run_local(2, adaptive_refused_for_a_nan, mode, timeout=HANG_S)
    assert steps == other_steps == [1, 1, 2, 3, 4]
    assert conserved <= 1e-4 * scale, conserved


def device_steps_refused_for_a_nan(rank: int, world: int) -> tuple[list[int], float, float]:
    """Device-route steps of a bucket holding a matrix and a bias (sent whole, its int8 rounding
    error kept), as DDP lays one out, the second refused for rank 1's NaN: what rank 0 fed in less
    what it was given is what it holds."""
    from sparsecomm.adaptive.config import Mode, Plan

    segments = (Segment("w", 0, 60_000), Segment("b", 60_000, 200, whole=True))
    fed = torch.zeros(60_200, dtype=torch.float64)
    delivered = torch.zeros_like(fed)
    steps = []
    with sc.GradientReducer(ADAPTIVE_SPEC) as reducer:
        reducer.adaptive.planner.plan = lambda: Plan(Mode.DEVICE, 0.01)
        for index in range(3):
            gradient = torch.randn(60_200, generator=torch.Generator().manual_seed(index)) * (rank == 0)
            if index == 1 and rank == 1:
                gradient[3] = float("nan")
            try:
                future = reducer.reduce_flat_async("bucket", gradient.clone(), segments, last=True)
                reducer.finish_step()
                delivered += future.wait().double() * world
            except sc.SparseCommError:
                assert index == 1
            fed += gradient.nan_to_num().double()
            steps.append(reducer.pipeline.states["w"].step)
        states = reducer.pipeline.states
        held = torch.cat([states["w"].feedback["residual"].reshape(-1), states["b"].codec_error.reshape(-1)])
    return steps, float((fed - delivered - held.double()).abs().max()), float(fed.abs().max())


def test_a_device_step_refused_for_one_ranks_nan_keeps_the_finite_ranks_gradient_and_rounding():
    (steps, conserved, scale), (other_steps, _, _) = run_local(2, device_steps_refused_for_a_nan, timeout=HANG_S)
    assert steps == other_steps == [1, 1, 2]
    assert conserved <= 1e-4 * scale, conserved


def beyond_fp16(rank: int, world: int, mode: str) -> tuple[list[str], bool, float]:
    """``mode`` steps whose wire is fp16 (fp16 dense steps, or the device route with fp16 values),
    rank 0's finite gradient at the second holding an entry beyond fp16's range: what each step
    did, whether the residual stayed finite, and the largest magnitude the planner knew after the
    second."""
    from sparsecomm.adaptive.config import Mode, Plan

    outcomes, magnitude = [], 0.0
    with sc.GradientReducer("adaptive+residual+rice+fp16+allgather") as reducer:
        reducer.adaptive.planner.plan = lambda: Plan(Mode(mode), 0.01)
        for index in range(4):
            gradient = torch.randn(300, 200, generator=torch.Generator().manual_seed(index))
            if index == 1 and rank == 0:
                gradient[3, 4] = 1e6
            outcomes.append(outcome(reducer.allreduce_, [("w", gradient)]))
            if index == 1:
                magnitude = reducer.adaptive.planner.costs.max_magnitude
        residual = reducer.pipeline.states["w"].feedback["residual"]
        return outcomes, bool(torch.isfinite(residual).all()), magnitude


@pytest.mark.parametrize("mode", ["fp16", "device"])
def test_a_finite_entry_beyond_fp16s_range_refuses_one_step_and_the_next_go_on(mode):
    """Every rank refuses the step whose fp16 wire overflowed; the finite rank keeps no Inf in its
    feedback (it would overflow every later step), and an fp16 dense step turns fp16 off until the
    largest magnitude is measured again."""
    for outcomes, finite, magnitude in run_local(2, beyond_fp16, mode, timeout=HANG_S):
        assert outcomes[0] == "ok" and "non-finite" in outcomes[1] and outcomes[2:] == ["ok", "ok"], outcomes
        assert finite
        if mode == "fp16":
            assert magnitude == math.inf


def dgc_momentum_after_a_sparse_step_with_a_nan(rank: int, world: int, policy: str) -> list[list[float]]:
    """``adaptive`` under DGC's momentum: a dense step (the momentum then common), a sparse step
    with rank 1's NaN (refused, or skipped by that rank), then dense steps: what each step handed back."""
    from sparsecomm.adaptive.config import Mode, Plan

    plans = iter([Plan(Mode.FP32), Plan(Mode.SPARSE, 0.01), Plan(Mode.FP32), Plan(Mode.FP32)])
    handed = []
    with sc.GradientReducer("adaptive", nonfinite=policy) as reducer:
        reducer.adaptive.planner.plan = lambda: next(plans)
        for index in range(4):
            gradient = torch.randn(300, 200, generator=torch.Generator().manual_seed(10 * index + rank))
            if index == 1 and rank == 1:
                gradient[3, 4] = float("nan")
            try:
                reducer.allreduce_([("w", gradient)])
            except sc.SparseCommError:
                assert index == 1 and policy == "raise"
            handed.append(gradient.reshape(-1)[:50].tolist())
    return handed


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_after_a_sparse_step_with_one_ranks_nan_dgcs_momentum_stays_one_on_every_rank(policy):
    """The rank with the NaN steps its momentum with zeros, as the finite rank stepped its own: the
    dense steps after it hand every rank the same update."""
    first, second = run_local(2, dgc_momentum_after_a_sparse_step_with_a_nan, policy, timeout=HANG_S)
    assert first[2:] == second[2:]


def codec_refusal_under_dgc_momentum(rank: int, world: int) -> float:
    """A step rank 1's fp16 codec refuses (a finite 1e6): how far rank 1's momentum is from one
    step of its gradient, m·b + g, but for the entry fp16 cannot carry, which is dropped (0)."""
    with sc.GradientReducer("topk(ratio=0.01)+dgc_momentum(momentum=0.9)+rice+fp16+allgather") as reducer:
        reducer.allreduce_([("w", torch.randn(300, 200, generator=torch.Generator().manual_seed(rank)))])
        before = reducer.pipeline.states["w"].feedback["momentum_buffer"].clone().reshape(-1)
        gradient = torch.randn(300, 200, generator=torch.Generator().manual_seed(10 + rank))
        if rank == 1:
            gradient[3, 4] = 1e6
        with pytest.raises(sc.SparseCommError, match="could not make its part"):
            reducer.allreduce_([("w", gradient.clone())])
        after = reducer.pipeline.states["w"].feedback["momentum_buffer"].reshape(-1)
        expected = 0.9 * before + gradient.reshape(-1)
        expected[expected.abs() > 65504] = 0.0
        return float((after - expected).abs().max())


def test_a_rank_whose_codec_refused_a_step_took_one_momentum_step_and_dropped_what_it_cannot_carry():
    assert run_local(2, codec_refusal_under_dgc_momentum, timeout=HANG_S)[1] <= 1e-5


def fails_once_when_posting(rank: int, world: int) -> list[str]:
    """The dense step's local stage fails on every rank at the first step: the step still ends."""
    from sparsecomm.adaptive.config import Mode, Plan
    from sparsecomm.reducer.call import Route

    outcomes = []
    with sc.GradientReducer(ADAPTIVE_SPEC) as reducer:
        reducer.adaptive.planner.plan = lambda: Plan(Mode.FP32)
        reducer.allreduce_([("w", torch.ones(300, 200))])
        path = reducer.runtime.paths[Route.DENSE_STEP]
        post = path.post

        def failing(*args, **kwargs):
            path.post = post
            raise sc.SparseCommError("this stage failed")

        path.post = failing
        for _ in range(2):
            outcomes.append(outcome(reducer.allreduce_, [("w", torch.ones(300, 200))]))
        outcomes.append(f"planner step {reducer.adaptive.planner.step}, steps {reducer.stats.steps}")
    return outcomes


def test_an_error_while_posting_a_call_ends_the_step_and_the_next_one_runs():
    for outcomes in run_local(2, fails_once_when_posting, timeout=HANG_S):
        assert "this stage failed" in outcomes[0] and outcomes[1:] == ["ok", "planner step 3, steps 3"], outcomes


def same_stream_twice(rank: int, world: int) -> list[list[float]]:
    """Two calls of one stream on the wire at once, on fp16 steps (a scratch wire each)."""
    from sparsecomm.adaptive.config import Mode, Plan

    with sc.GradientReducer(ADAPTIVE_SPEC) as reducer:
        reducer.adaptive.planner.plan = lambda: Plan(Mode.FP16)
        averages = []
        for step in range(2):
            first = reducer.reduce_async("w", torch.full((100, 100), float(rank + step)))
            second = reducer.reduce_async("w", torch.full((100, 100), float(100 * (rank + step))))
            reducer.finish_step()
            averages.append([float(first.wait().mean()), float(second.wait().mean())])
    return averages


def test_two_calls_of_one_stream_in_a_step_each_get_their_own_average():
    for averages in run_local(2, same_stream_twice, timeout=HANG_S):
        assert averages == [[0.5, 50.0], [1.5, 150.0]], averages
