"""`LinkBudget`, the adaptive pipeline's plan: each step's mode (dense fp32, fp16, sparse) and
density come from agreed numbers alone, by the rules its module states. Reports are built here as
every rank's MAX-reduced report would be, so these tests need no process group."""

import math

import pytest
import torch

import sparsecomm as sc
from sparsecomm.components import Adaptive
from sparsecomm.integration.budget import (
    COST_WINDOW,
    DENSE,
    EXPLORE_SHARE,
    HALF,
    MAX_SPARSE_DENSITY,
    MIN_REEXPLORE,
    SPARSE,
    SPARSE_MARGIN,
    LinkBudget,
    Plan,
    StepMeasurement,
    typical,
)

N = 1_000_000
DENSE_BYTES = 4 * N  # an fp32 all_reduce at P = 2, in allgather bytes per rank


def report(compute=0.0, throughput=0.0, dense=None, half=None, sparse=None, per_nnz=0.0, fixed=0.0,
           magnitude=0.0, encode=0.0, decode=0.0) -> torch.Tensor:
    """One step's agreed report (see `LinkBudget.end_step`): throughput negated, unmeasured +inf;
    unmeasured costs 0. ``sparse``: a sparse step's whole time beyond its per-byte cost."""
    return torch.tensor([compute, -throughput if throughput else math.inf, dense or 0.0, half or 0.0,
                         sparse or 0.0, per_nnz, fixed, magnitude, encode, decode], dtype=torch.float64)


def budget(**settings) -> LinkBudget:
    plan = LinkBudget(Adaptive(**settings), world_size=2)
    plan.total_numel = plan.budget_numel = N
    return plan


def next_plan(plan: LinkBudget, agreed: torch.Tensor | None = None) -> Plan:
    if agreed is not None:
        plan.observe(agreed)
    chosen = plan.begin_step(now=0.0)
    plan.measuring.total_numel = plan.measuring.budget_numel = N  # as the reducer counts each call
    plan.end_step()
    return chosen


def measured(plan: LinkBudget, sparse: float, **first) -> LinkBudget:
    """``plan`` after its first step, one report of ``first`` and `COST_WINDOW` sparse steps that
    cost ``sparse`` each beyond their wire time."""
    next_plan(plan)
    plan.observe(report(**first))
    for _ in range(COST_WINDOW):
        plan.observe(report(sparse=sparse))
    return plan


def test_the_first_step_is_dense_and_so_is_every_probe_step():
    plan = budget(probe=10)
    assert next_plan(plan) == Plan(DENSE)  # nothing measured yet
    slow = report(compute=0.002, throughput=12.5e6, dense=0.3, per_nnz=2.0, magnitude=1.0)
    modes = [next_plan(plan, slow).mode for _ in range(1, 25)]
    assert modes[9] == DENSE and modes[19] == DENSE  # steps 10 and 20
    assert modes.count(SPARSE) == 22


def test_with_the_link_timed_at_start_up_the_first_step_is_sparse_at_the_floor():
    plan = budget(probe=10, floor=0.002)
    plan.observe_link(12.5e6)
    assert next_plan(plan) == Plan(SPARSE, 0.002)  # the compute is not timed yet: the cheapest step
    slow = report(compute=0.002, throughput=12.5e6, per_nnz=2.0, magnitude=1.0)
    modes = [next_plan(plan, slow).mode for _ in range(1, 25)]
    assert modes[9] == DENSE and modes[19] == DENSE and modes.count(SPARSE) == 22  # probes as before


def test_a_link_that_carries_the_whole_gradient_within_the_compute_time_gets_dense_steps():
    plan = budget()
    next_plan(plan)
    fast = report(compute=0.010, throughput=10e9, dense=0.004, half=0.001, sparse=0.0001, per_nnz=2.0, magnitude=1.0)
    assert {next_plan(plan, fast).mode for _ in range(30)} == {DENSE}


def test_a_slow_link_explores_sparse_at_the_floor_then_sends_what_it_carries_while_the_step_computes():
    plan = budget(floor=0.0005)
    next_plan(plan)
    # 10 MB/s and 2 ms of compute: 20 kB per step; 1 kB of it goes outside the budget
    measured = dict(compute=0.002, throughput=10e6, dense=0.4, per_nnz=2.0, fixed=1000.0, magnitude=1.0)
    assert next_plan(plan, report(**measured)) == Plan(SPARSE, 0.0005)  # sparse cost unknown: cheap steps
    assert next_plan(plan, report(**measured)) == Plan(SPARSE, 0.0005)
    chosen = next_plan(plan, report(**measured, sparse=0.003))
    assert chosen.mode == SPARSE and chosen.density == pytest.approx((20_000 - 1000) / (2.0 * N))


def test_the_codecs_time_per_byte_shrinks_the_budget_to_what_link_and_codecs_carry_while_computing():
    plan = LinkBudget(Adaptive(), world_size=3)
    plan.total_numel = plan.budget_numel = N
    next_plan(plan)
    # 10 MB/s (100 ns a byte on the wire), 2 ms of compute; 40 ns a byte to encode, 20 to decode:
    # a rank encodes its bytes and receives and decodes the two others'
    measured = dict(compute=0.002, throughput=10e6, dense=0.4, per_nnz=2.0, magnitude=1.0, sparse=0.001)
    next_plan(plan, report(**measured, encode=40e-9, decode=20e-9))
    chosen = next_plan(plan, report(**measured, encode=40e-9, decode=20e-9))
    assert plan.step_budget() == pytest.approx(0.002 / (40e-9 + 2 * (20e-9 + 100e-9)))
    assert chosen.density == pytest.approx(plan.step_budget() / (2.0 * N))


def test_the_sparse_paths_marginal_cost_is_a_slope_not_an_average():
    from sparsecomm.integration.budget import marginal_sparse_cost

    sending, receiving = marginal_sparse_cost(sc.resolve("adaptive"))
    assert 0 < sending < 1e-6 and 0 < receiving < 1e-6  # nanoseconds a byte, not the milliseconds of a pass


def test_sparse_density_stops_at_its_ceiling_and_dense_wins_where_it_costs_no_more():
    # a budget worth more than a quarter of the entries, sparse steps that cost a lot of CPU, and
    # magnitudes too large for fp16
    plan = measured(budget(), sparse=0.020, compute=0.002, throughput=1e9, dense=0.006, per_nnz=2.0, magnitude=1e5)
    assert next_plan(plan) == Plan(DENSE)
    cheap = measured(budget(), sparse=0.0005, compute=0.002, throughput=1e9, dense=0.006, per_nnz=2.0, magnitude=1.0)
    assert next_plan(cheap) == Plan(SPARSE, MAX_SPARSE_DENSITY)


def test_fp16_steps_need_headroom_below_fp16s_range_and_must_beat_fp32():
    for magnitude, half_cost, expected in [(1.0, 0.002, HALF), (1e4, 0.002, DENSE), (1.0, 0.008, DENSE)]:
        plan = measured(budget(), sparse=0.050, compute=0.002, throughput=1e9, dense=0.006, half=half_cost,
                        per_nnz=2.0, magnitude=magnitude)
        assert next_plan(plan).mode == expected, (magnitude, half_cost)


def test_a_runner_up_runs_again_once_its_extra_cost_is_a_small_share_of_the_time_since():
    plan = measured(budget(probe=0), sparse=0.050, compute=0.002, throughput=1e9, dense=0.006, half=0.005, per_nnz=2.0,
                    magnitude=1.0)
    # sparse (52 ms and more, with its margin) is over 51.7 ms dearer: due after this many steps
    sparse_due = (0.052 * (1 + SPARSE_MARGIN) - 0.0055) / (EXPLORE_SHARE * 0.0055)
    modes = [next_plan(plan).mode for _ in range(int(sparse_due) + MIN_REEXPLORE)]
    # fp16 wins: 5.5 ms a step with its margin, against 6 ms for fp32 and 52 ms for sparse
    # fp32, 0.5 ms dearer, runs again as often as allowed
    dense_steps = [step for step, mode in enumerate(modes, 1) if mode == DENSE]
    gaps = {later - earlier for earlier, later in zip([0, *dense_steps[:-1]], dense_steps, strict=True)}
    assert gaps <= {MIN_REEXPLORE, MIN_REEXPLORE + 1}  # + 1: once, when sparse's turn came first
    # sparse once its extra cost is EXPLORE_SHARE of the steps' time since it last ran
    sparse_steps = [step for step, mode in enumerate(modes, 1) if mode == SPARSE]
    assert len(sparse_steps) == 1 and sparse_steps[0] >= sparse_due


def test_an_unlucky_first_measurement_is_checked_again_and_corrected():
    # no probe steps: the re-check alone; the first steps saw the link at a tenth of its speed:
    # dense predicted at 41 ms, sparse costs 2 ms
    plan = measured(budget(probe=0), sparse=0.002, compute=0.001, throughput=100e6, per_nnz=2.0, magnitude=1e5)
    modes = []
    while DENSE not in modes:
        modes.append(next_plan(plan).mode)
    assert len(modes) <= 0.040 / (EXPLORE_SHARE * 0.003) + 1
    plan.observe(report(dense=0.001))  # the dense step cost 1 ms
    assert {next_plan(plan).mode for _ in range(MIN_REEXPLORE - 1)} == {DENSE}


def test_a_dense_modes_cost_is_its_whole_step_so_compute_it_slowed_counts_against_it():
    plan = budget(probe=0)
    for _ in range(5):  # past the warm-up steps
        next_plan(plan)
    plan.current = Plan(HALF)
    # an fp16 step whose collective waited 1 ms but slowed the backward to 6 ms (gloo's fp16 sums
    # share the processor with it): 7 ms
    plan.measuring = StepMeasurement(forward_start=0.0, last_submit=0.0065, last_done=0.0075, local_s=0.0005)
    assert plan.end_step()[3].item() == pytest.approx(0.0075)
    # against it, an fp32 step not yet run: 3 ms of compute and 4 MB at 1 GB/s
    plan.observe(report(compute=0.003, throughput=1e9, half=0.0075, per_nnz=2.0, magnitude=1.0))
    for _ in range(COST_WINDOW):
        plan.observe(report(sparse=0.050))
    assert next_plan(plan).mode == DENSE


def test_fp16_is_tried_only_once_fp32_has_been_measured_and_judged_by_its_median_step():
    # a fast link: fp16 would be predicted at 1.5 + 1 ms (x1.1) against fp32's 1.5 + 2 ms, but fp32 runs first
    plan = measured(budget(probe=0), sparse=0.050, compute=0.0015, throughput=2e9, per_nnz=2.0, magnitude=1.0)
    assert next_plan(plan).mode == DENSE
    plan.observe(report(dense=0.0035))
    assert next_plan(plan).mode == HALF  # predicted at 3.5 - 1 ms, x1.1
    for half in (0.0025, 0.006, 0.006, 0.006, 0.006):  # one lucky fp16 step among slow ones
        plan.observe(report(half=half))
    assert {next_plan(plan).mode for _ in range(MIN_REEXPLORE - 1)} == {DENSE}


def test_a_step_in_another_mode_than_the_step_before_is_flagged_so_that_its_cost_is_reported():
    plan = measured(budget(), sparse=0.050, compute=0.002, throughput=1e9, dense=0.006, half=0.005, per_nnz=2.0,
                    magnitude=1.0)
    modes, switched = [], []
    for _ in range(3 * MIN_REEXPLORE):
        modes.append(next_plan(plan).mode)
        switched.append(plan.switched)
    assert DENSE in modes and HALF in modes
    assert switched[1:] == [now != before for before, now in zip(modes, modes[1:], strict=False)]


def test_a_user_set_budget_decides_by_bytes_alone_and_never_probes():
    for bytes_, expected in [(DENSE_BYTES, DENSE), (DENSE_BYTES // 2, HALF), (20_000, SPARSE)]:
        plan = budget(budget=bytes_)
        next_plan(plan)
        plan.observe(report(per_nnz=2.0, magnitude=1.0))
        modes = {next_plan(plan).mode for _ in range(250)}
        assert modes == {expected}, bytes_


def test_the_plan_follows_the_slowest_compute_link_and_step():
    one = report(compute=0.001, throughput=20e6, dense=0.2, sparse=0.004)
    two = report(compute=0.003, throughput=10e6, dense=0.5, sparse=0.005)
    plan = budget()
    plan.observe(torch.maximum(one, two))  # what every rank makes of every rank's report
    assert plan.compute_s[-1] == 0.003 and plan.throughput[-1] == 10e6 and plan.dense_cost_s[-1] == 0.5
    assert plan.sparse_overhead_s[-1] == pytest.approx(0.002)  # the slowest sparse step beyond the slowest compute


def test_a_modes_cost_is_the_mean_of_its_middle_steps_blind_to_a_rare_slow_one():
    plan = measured(budget(probe=0), sparse=0.050, compute=0.002, throughput=1e9, per_nnz=2.0, magnitude=1e5)
    for cost in (0.0030, 0.0031, 0.0029, 0.0300, 0.0030, 0.0032, 0.0028, 0.0030):
        plan.observe(report(dense=cost))
    assert typical(plan.dense_cost_s) == pytest.approx(0.0030, abs=5e-5)


def test_the_budget_state_round_trips_through_a_checkpoint():
    plan = budget()
    next_plan(plan)
    for cost in (0.003, 0.004):
        next_plan(plan, report(compute=0.002, throughput=10e6, dense=0.4, sparse=cost, per_nnz=2.0, magnitude=3.0))
    restored = budget()
    restored.load_state_dict(plan.state_dict())
    assert restored.state_dict() == plan.state_dict()
    assert next_plan(restored) == next_plan(plan)
