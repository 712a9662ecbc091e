"""`Planner`, the adaptive pipeline's plan: each step's mode (dense fp32, fp16, sparse) and
density come from agreed numbers alone, by the rules its module states. Reports are built here as
every rank's MAX-reduced report would be, so these tests need no process group."""

import itertools
import math
from collections import deque
from dataclasses import replace

import pytest
import torch

import sparsecomm as sc
from sparsecomm.adaptive.config import AdaptiveConfig, Mode, Plan
from sparsecomm.adaptive.measurement import StepMeasurement, typical
from sparsecomm.adaptive.planner import Planner
from sparsecomm.adaptive.report import Report
from sparsecomm.components import Adaptive
from sparsecomm.presets import resolve

FP32, FP16, SPARSE = Mode.FP32, Mode.FP16, Mode.SPARSE
CONFIG = AdaptiveConfig()
COST_WINDOW, ENERGY_EVERY, EXPLORE_SHARE, MAX_SPARSE_DENSITY = (CONFIG.cost_window, CONFIG.energy_every,
                                                                CONFIG.explore_share, CONFIG.max_sparse_density)
MIN_REEXPLORE, PAIR_WINDOW, TRIAL_PAIRS, WARMUP_STEPS = (CONFIG.min_reexplore, CONFIG.pair_window, CONFIG.trial_pairs,
                                                         CONFIG.warmup_steps)

N = 1_000_000
DENSE_BYTES = 4 * N  # an fp32 all_reduce at P = 2, in allgather bytes per rank


def report(compute=0.0, throughput=0.0, fp32=None, fp16=None, sparse=None, per_nnz=0.0, fixed=0.0,
           magnitude=0.0, encode=0.0, decode=0.0, preferred=0.0) -> Report:
    """One step's agreed report (see `Planner.end_step`): unmeasured throughput and costs 0.
    ``sparse``: a sparse step's whole time beyond its per-byte cost; ``preferred``: the density the
    ranks' gradients preferred."""
    return Report(compute, throughput, fp32 or 0.0, fp16 or 0.0, sparse or 0.0, per_nnz, fixed, magnitude, encode,
                  decode, preferred)


def budget(**settings) -> Planner:
    """A planner whose sparse steps may start at once (``dense_start=0`` unless told)."""
    plan = Planner(Adaptive(**{"dense_start": 0, **settings}), world_size=2)
    plan.costs.total_numel = plan.costs.budget_numel = N
    return plan


def next_plan(plan: Planner, agreed: torch.Tensor | None = None) -> Plan:
    if agreed is not None:
        plan.observe(agreed)
    chosen = plan.begin_step(now=0.0)
    plan.measuring.total_numel = plan.measuring.budget_numel = N  # as the reducer counts each call
    plan.end_step()
    return chosen


def measured(plan: Planner, sparse: float, **first) -> Planner:
    """``plan`` after its first step, one report of ``first`` and `COST_WINDOW` sparse steps that
    cost ``sparse`` each beyond their wire time."""
    next_plan(plan)
    plan.observe(report(**first))
    for _ in range(COST_WINDOW):
        plan.observe(report(sparse=sparse))
    return plan


def test_the_first_steps_are_dense_as_dgcs_warm_up_then_the_link_decides():
    plan = Planner(Adaptive(dense_start=5), world_size=2)
    plan.costs.total_numel = plan.costs.budget_numel = N
    plan.costs.observe_link(12.5e6)  # a slow link, timed at start-up
    slow = report(compute=0.002, throughput=12.5e6, fp32=0.3, per_nnz=2.0, magnitude=1.0)
    modes = [next_plan(plan, slow if step else None).mode for step in range(10)]
    assert modes[:5] == [FP32] * 5 and modes[5:] == [SPARSE] * 5
    user = Planner(Adaptive(budget=1000, dense_start=5), world_size=2)
    user.costs.total_numel = user.costs.budget_numel = N
    assert next_plan(user).mode == SPARSE  # a user's byte budget holds from the first step


def test_the_warm_up_eases_sparsity_in_from_a_quarter_of_the_entries_to_the_floor():
    plan = Planner(Adaptive(warmup=4, floor=0.01), world_size=2)
    plan.costs.total_numel = plan.costs.budget_numel = N
    plan.costs.observe_link(12.5e6)  # a slow link, timed at start-up
    slow = report(compute=0.002, throughput=12.5e6, fp32=0.3, per_nnz=2.0, magnitude=1.0, sparse=0.001)
    plans = [next_plan(plan, slow if step else None) for step in range(11)]
    assert all(p.mode == SPARSE for p in plans)
    densities = [p.density for p in plans]
    # a quarter for 4 steps, falling by (0.01 / 0.25) ** (1 / 4) a step over 4 more, then the
    # planner's own choice above the floor
    assert densities[:8] == pytest.approx([0.25] * 4 + [0.25 * 0.04 ** (step / 4) for step in range(4)])
    assert min(densities[8:]) >= 0.01 and max(densities[8:]) < densities[7]
    user = Planner(Adaptive(budget=1000, warmup=4, floor=0.01), world_size=2)
    user.costs.total_numel = user.costs.budget_numel = N
    assert next_plan(user) == Plan(SPARSE, 0.01)  # a user's byte budget holds from the first step


def test_the_first_step_is_dense_and_so_is_every_probe_step():
    plan = budget(probe=10)
    assert next_plan(plan) == Plan(FP32)  # nothing measured yet
    slow = report(compute=0.002, throughput=12.5e6, fp32=0.3, per_nnz=2.0, magnitude=1.0)
    modes = [next_plan(plan, slow).mode for _ in range(1, 25)]
    assert modes[9] == FP32 and modes[19] == FP32  # steps 10 and 20
    assert modes.count(SPARSE) == 22


def test_with_the_link_timed_at_start_up_the_first_step_is_sparse_at_the_exploring_density():
    for floor, density in ((0.002, CONFIG.explore_density), (0.1, 0.1)):  # a higher floor holds
        plan = budget(probe=10, floor=floor)
        plan.costs.observe_link(12.5e6)
        assert next_plan(plan) == Plan(SPARSE, density)  # the compute is not timed yet: a cheap step
    slow = report(compute=0.002, throughput=12.5e6, per_nnz=2.0, magnitude=1.0)
    modes = [next_plan(plan, slow).mode for _ in range(1, 25)]
    assert modes[9] == FP32 and modes[19] == FP32 and modes.count(SPARSE) == 22  # probes as before


def test_a_link_that_carries_the_whole_gradient_within_the_compute_time_gets_dense_steps():
    plan = budget()
    next_plan(plan)
    fast = report(compute=0.010, throughput=10e9, fp32=0.004, fp16=0.001, sparse=0.0001, per_nnz=2.0, magnitude=1.0)
    assert {next_plan(plan, fast).mode for _ in range(30)} == {FP32}


def test_a_slow_link_explores_sparse_at_a_few_percent_then_sends_what_it_carries_while_the_step_computes():
    plan = budget(floor=0.0005)
    next_plan(plan)
    # 10 MB/s and 2 ms of compute: 20 kB per step; 1 kB of it goes outside the budget
    measured = dict(compute=0.002, throughput=10e6, fp32=0.4, per_nnz=2.0, fixed=1000.0, magnitude=1.0)
    exploring = Plan(SPARSE, CONFIG.explore_density)  # sparse cost unknown: cheap steps, not the floor's
    assert next_plan(plan, report(**measured)) == exploring  # which would hold back nearly all
    assert next_plan(plan, report(**measured)) == exploring
    chosen = next_plan(plan, report(**measured, sparse=0.003))
    assert chosen.mode == SPARSE and chosen.density == pytest.approx((20_000 - 1000) / (2.0 * N))


@pytest.mark.parametrize("throughput, between, alternates", [(100e6, CONFIG.explore_between, True),
                                                             (10e6, CONFIG.explore_between, False),
                                                             (100e6, 1.5, False)])
def test_where_a_dense_step_costs_a_few_sparse_ones_a_dense_step_follows_each_exploring_one(throughput, between,
                                                                                           alternates):
    plan = Planner(Adaptive(dense_start=0, floor=0.0005), world_size=2,
                   config=AdaptiveConfig(explore_between=between))
    plan.costs.total_numel = plan.costs.budget_numel = N
    next_plan(plan)
    # 20 ms of compute; the fp16 gradient (2 MB) crosses 100 MB/s in 20 ms: an fp16 step is
    # predicted at about twice an exploring sparse one (ten times at 10 MB/s)
    measured = report(compute=0.020, throughput=throughput, per_nnz=2.0, magnitude=1.0)
    modes = [next_plan(plan, measured).mode for _ in range(6)]
    assert modes == ([SPARSE, FP16] * 3 if alternates else [SPARSE] * 6)


@pytest.mark.parametrize("setting, field", [({"explore_between": -1.0}, "explore_between"),
                                            ({"explore_density": 0.5}, "explore_density"),
                                            ({"trial_pairs": 0}, "trial_pairs"),
                                            ({"max_sparse_density": 0.0}, "max_sparse_density"),
                                            ({"calibration_nnz": (10, 5)}, "calibration_nnz")])
def test_the_controllers_settings_are_checked(setting, field):
    with pytest.raises(sc.SparseCommError, match=field):
        AdaptiveConfig(**setting)
    assert AdaptiveConfig(explore_between=0.0).explore_between == 0.0  # 0: exploring steps run on end


def test_the_codecs_time_per_byte_shrinks_the_budget_to_what_link_and_codecs_carry_while_computing():
    plan = Planner(Adaptive(dense_start=0), world_size=3)
    plan.costs.total_numel = plan.costs.budget_numel = N
    next_plan(plan)
    # 10 MB/s (100 ns a byte on the wire), 2 ms of compute; 40 ns a byte to encode, 20 to decode:
    # a rank encodes its bytes and receives and decodes the two others'
    measured = dict(compute=0.002, throughput=10e6, fp32=0.4, per_nnz=2.0, magnitude=1.0, sparse=0.001)
    next_plan(plan, report(**measured, encode=40e-9, decode=20e-9))
    chosen = next_plan(plan, report(**measured, encode=40e-9, decode=20e-9))
    assert plan.costs.step_budget() == pytest.approx(0.002 / (40e-9 + 2 * (20e-9 + 100e-9)))
    assert chosen.density == pytest.approx(plan.costs.step_budget() / (2.0 * N))


@pytest.mark.parametrize("world_size", [2, 8, 64])
def test_a_global_top_k_transport_is_priced_at_two_selections_where_an_allgather_brings_p_minus_one(world_size):
    # the same measurements; only what the transport brings back per byte sent differs
    measured = dict(compute=0.002, throughput=10e6, fp32=0.4, per_nnz=2.0, magnitude=1.0, sparse=0.001)
    budgets = {}
    for spec in ("adaptive+residual+raw+fp32+allgather",
                 "adaptive+residual+raw+fp32+sparse_allreduce(algorithm=topk_sa)"):
        resolved = resolve(spec)
        received = resolved.transport.received_per_sent(world_size)
        plan = Planner(replace(resolved.sparsifier, dense_start=0), world_size, received_per_sent=received)
        plan.costs.total_numel = plan.costs.budget_numel = N
        next_plan(plan)
        next_plan(plan, report(**measured))
        budgets[spec.split("+")[-1]] = plan.costs.step_budget()
    assert budgets["allgather"] == pytest.approx(0.002 * 10e6 / (world_size - 1))
    assert budgets["sparse_allreduce(algorithm=topk_sa)"] == pytest.approx(
        0.002 * 10e6 * world_size / (2 * (world_size - 1)))


def test_a_reducers_adaptive_controller_prices_bytes_by_its_transport():
    from sparsecomm.adaptive.controller import AdaptiveController

    spec = resolve("adaptive(budget=1000)+residual+raw+fp32+sparse_allreduce(algorithm=topk_sa)")
    controller = AdaptiveController.of(spec, 8, None, torch.device("cpu"), None)
    assert controller is not None and controller.planner.costs.received_per_sent == pytest.approx(2 * 7 / 8)
    plain = AdaptiveController.of(resolve("adaptive(budget=1000)+residual+raw+fp32+allgather"), 8, None,
                                  torch.device("cpu"), None)
    assert plain is not None and plain.planner.costs.per_byte_s(1e6) == pytest.approx(7e-6)


def test_the_sparse_paths_marginal_cost_is_a_slope_not_an_average():
    from sparsecomm.adaptive.calibration import marginal_sparse_cost

    sending, receiving = marginal_sparse_cost(resolve("adaptive"))
    assert 0 < sending < 1e-6 and 0 < receiving < 1e-6  # nanoseconds a byte, not the milliseconds of a pass


def test_a_calibration_that_noise_swamps_is_taken_again():
    from sparsecomm.adaptive import calibration

    # each timed call reads the clock three times (start, after sending, after receiving); the warm
    # calls and the first attempt time the small selection as the dearer one, the second the large
    calls = {"timed": 0, "reads": 0, "now": 0.0}
    warm = 2 * 2

    def clock() -> float:
        if calls["reads"] % 3 != 0:
            index = calls["timed"] - 1
            large = index % 2 == 1
            noisy = index < warm + 2
            calls["now"] += (1e-3 if large == noisy else 3e-3)
        else:
            calls["timed"] += 1
        calls["reads"] += 1
        return calls["now"]

    sending, receiving = calibration.marginal_sparse_cost(resolve("adaptive"), numel=4096, nnz=(16, 1024),
                                                          repeats=1, attempts=3, clock=clock)
    assert calls["timed"] == warm + 2 * 2  # one noisy attempt, one clean one
    assert sending > 0 and receiving > 0
    assert sending == pytest.approx(receiving)


def test_sparse_density_stops_at_its_ceiling_and_dense_wins_where_it_costs_no_more():
    # a budget worth more than a quarter of the entries, sparse steps that cost a lot of CPU, and
    # magnitudes too large for fp16
    plan = measured(budget(), sparse=0.020, compute=0.002, throughput=1e9, fp32=0.006, per_nnz=2.0, magnitude=1e5)
    assert next_plan(plan) == Plan(FP32)
    cheap = measured(budget(), sparse=0.0005, compute=0.002, throughput=1e9, fp32=0.006, per_nnz=2.0, magnitude=1.0)
    assert next_plan(cheap) == Plan(SPARSE, MAX_SPARSE_DENSITY)


def sampled(plan: Planner, squares: torch.Tensor) -> float:
    """The density ``plan`` prefers for a gradient whose sampled squares are ``squares``."""
    return plan.costs.energy_density([squares])


def power_law(gamma: float, count: int = 100_000) -> torch.Tensor:
    """Squares whose largest fraction f holds f**gamma of their sum (shuffled: order is no matter)."""
    held = (torch.arange(count + 1, dtype=torch.float64) / count).pow(gamma)
    return held.diff()[torch.randperm(count, generator=torch.Generator().manual_seed(0))].float()


# 2 ms of compute, 0.5 ms of sparse overhead; 10 MB/s at P = 2 and 2 bytes a nonzero: 0.2 s per unit
# of density over the 1M entries
COSTS = dict(sparse=0.0005, compute=0.002, throughput=10e6, per_nnz=2.0, magnitude=1.0)


def test_the_preferred_density_sends_the_most_gradient_energy_per_second_of_step():
    # E(d) = d**gamma: the most energy per second where the elasticity gamma equals the share of the
    # step spent on the payload, c·d = T0·gamma / (1 − gamma). Near it the energy per second is flat
    # (within 1% from 0.8 to 1.2 times it at gamma = 0.7), so the histogram's small error moves the pick
    for gamma in (0.3, 0.5, 0.7):
        plan = measured(budget(horizon=1.0, floor=0.0001), **COSTS)
        expected = 0.0025 * gamma / (1 - gamma) / 0.2
        assert sampled(plan, power_law(gamma)) == pytest.approx(expected, rel=0.25), gamma


def test_a_gradient_held_by_few_entries_is_sent_at_the_floor_and_a_flat_one_up_to_its_horizon():
    concentrated = torch.zeros(100_000)
    concentrated[::10_000] = 1.0  # 10 entries, a hundredth of the floor's share
    assert sampled(measured(budget(floor=0.001), **COSTS), concentrated) == pytest.approx(0.001)
    flat = torch.ones(100_000)
    # what a step leaves out is sent within the horizon: a flat gradient needs 1/H of its entries a step
    for horizon, expected in ((8.0, 1 / 8), (20.0, 1 / 20), (1.0, MAX_SPARSE_DENSITY)):
        assert sampled(measured(budget(horizon=horizon), **COSTS), flat) == pytest.approx(expected, rel=0.1)


def test_a_gradient_not_measured_yet_or_without_energy_states_no_preference():
    assert sampled(budget(), power_law(0.5)) == 0.0  # no compute or link measured yet
    plan = measured(budget(), **COSTS)
    assert sampled(plan, torch.zeros(1000)) == 0.0 and plan.costs.energy_density([]) == 0.0
    assert sampled(plan, torch.tensor([1.0, math.nan])) == 0.0


def test_sparse_steps_run_at_the_density_the_ranks_gradients_preferred():
    plan = measured(budget(probe=0), **COSTS)
    for preferred in (0.004, 0.020, 0.005):  # each the largest of its step's ranks
        plan.observe(report(preferred=preferred))
    assert next_plan(plan) == Plan(SPARSE, 0.005)  # their median
    plan.observe(report(preferred=0.0))  # a step that measured none leaves the window as it was
    assert list(plan.costs.preferred_density) == [0.004, 0.020, 0.005]


def sampling(plan: Planner, steps: int) -> list[tuple[int, bool]]:
    """For each of ``plan``'s next ``steps`` (all sparse): the sparse steps before it, and whether it
    samples the gradient for its energy curve."""
    seen = []
    for _ in range(steps):
        before = plan.sparse_steps
        assert plan.begin_step(now=0.0).mode == SPARSE
        seen.append((before, plan.measuring.wants_energy))
        plan.measuring.total_numel = plan.measuring.budget_numel = N
        plan.end_step()
    return seen


def test_every_sparse_step_samples_until_the_first_preferred_density_then_every_few():
    plan = measured(budget(probe=0), **COSTS)
    assert all(wants for _, wants in sampling(plan, 2 * ENERGY_EVERY))  # the first choices need one soon
    plan.observe(report(preferred=0.01))
    assert all(wants == (before % ENERGY_EVERY == 0) for before, wants in sampling(plan, 2 * ENERGY_EVERY))


def test_each_rank_reports_the_density_its_own_sampled_gradient_prefers():
    plan = measured(budget(horizon=1.0), **COSTS)
    plan.observe(report(preferred=0.01))  # one known: the sparse steps sample every few
    while plan.sparse_steps % ENERGY_EVERY:  # the sparse steps between sample nothing
        plan.begin_step(now=0.0)
        assert not plan.measuring.wants_energy
        plan.measuring.total_numel = plan.measuring.budget_numel = N
        plan.end_step()
    plan.begin_step(now=0.0)
    plan.measuring.total_numel = plan.measuring.budget_numel = N
    gradient = power_law(0.5, N).sqrt()
    plan.sample_energy(gradient, [(0, N)])
    assert sum(sample.numel() for sample in plan.measuring.energy_samples) == pytest.approx(N / 61, abs=1)
    reported = plan.end_step()
    assert reported.preferred_density == pytest.approx(sampled(plan, power_law(0.5, N)), rel=0.25)  # from a 1/61 sample


def test_no_gradient_is_sampled_on_dense_steps_or_under_a_user_set_budget():
    fast = report(compute=0.010, throughput=10e9, fp32=0.004, per_nnz=2.0, magnitude=1.0)
    for plan, first in ((budget(), fast), (budget(budget=20_000), report(per_nnz=2.0))):
        next_plan(plan, first)
        plan.begin_step(now=0.0)
        plan.sample_energy(torch.ones(N), [(0, N)])
        assert not plan.measuring.wants_energy and plan.measuring.energy_samples == []


def test_the_horizon_is_the_feedbacks_momentum_memory_unless_the_sparsifier_sets_one():
    flat = torch.ones(100_000)  # sent at 1/H of its entries a step
    for spec, expected in (("adaptive+dgc_momentum(momentum=0.9)+rice+int8+allgather", 1 / 10),
                           ("adaptive+dgc_momentum(momentum=0.8)+rice+int8+allgather", 1 / 5),
                           ("adaptive+residual+rice+int8+allgather", MAX_SPARSE_DENSITY),
                           ("adaptive(horizon=20)+dgc_momentum(momentum=0.9)+rice+int8+allgather", 1 / 20)):
        resolved = resolve(spec)
        plan = Planner(resolved.sparsifier, 2, resolved.feedback.delay_horizon())
        plan.costs.total_numel = plan.costs.budget_numel = N
        assert sampled(measured(plan, **COSTS), flat) == pytest.approx(expected, rel=0.1), spec
    with pytest.raises(sc.SparseCommError, match="horizon"):
        Adaptive(horizon=0.5)


def test_fp16_steps_need_headroom_below_fp16s_range_and_must_beat_fp32():
    for magnitude, half_cost, expected in [(1.0, 0.002, FP16), (1e4, 0.002, FP32), (1.0, 0.008, FP32)]:
        plan = measured(budget(), sparse=0.050, compute=0.002, throughput=1e9, fp32=0.006, fp16=half_cost,
                        per_nnz=2.0, magnitude=magnitude)
        assert next_plan(plan).mode == expected, (magnitude, half_cost)


def steps(plan: Planner, count: int, cost_of) -> list[str]:
    """``count`` steps as the reducer runs them: step s costs ``cost_of(mode, s)`` seconds in its
    mode, and its report is observed, with its step, when step s + 2 begins."""
    modes, pending = [], []
    for _ in range(count):
        while pending and pending[0][0] <= plan.step - 2:
            step, agreed = pending.pop(0)
            plan.observe(agreed, step)
        chosen = next_plan(plan)
        modes.append(chosen.mode)
        pending.append((plan.step - 1, report(**{chosen.mode.value: cost_of(chosen.mode, plan.step - 1)})))
    return modes


def dense_incumbent(**costs) -> Planner:
    """fp32 chosen on a fast link while fp16 was not allowed (magnitudes too large), then allowed:
    fp16 (never run, predicted 6 - 2 ms) is tried at once."""
    plan = measured(budget(probe=0), sparse=0.050, compute=0.002, throughput=1e9, per_nnz=2.0, magnitude=1e5, **costs)
    while plan.step <= WARMUP_STEPS:  # no trials while steps are slow for reasons of their own
        assert next_plan(plan) == Plan(FP32)
    plan.observe(report(magnitude=1.0))
    return plan


@pytest.mark.parametrize("half, wins", [(0.0035, True), (0.0068, False)])
def test_a_challenger_runs_next_to_the_incumbent_and_replaces_it_only_if_clearly_cheaper_in_that_trial(half, wins):
    plan = dense_incumbent(fp32=0.006)
    modes = steps(plan, 20, lambda mode, step: {FP32: 0.006, FP16: half}[mode])
    assert modes[:2 * TRIAL_PAIRS] == [FP16, FP32] * TRIAL_PAIRS  # alternating, the challenger first
    # while the trial's last report travels, the incumbent; then the winner (fp16 by 2.5 ms, 0.58 of
    # fp32's step: below 1 / 1.1 / CLEAR_WIN = 0.61, or not at all), until the loser's next trial
    assert modes[2 * TRIAL_PAIRS:] == [FP32] + [FP16 if wins else FP32] * (20 - 2 * TRIAL_PAIRS - 1)
    assert plan.trials.incumbent == (FP16 if wins else FP32)


def test_a_win_within_a_steps_noise_needs_a_second_trial():
    # fp16 at 0.83 of fp32's step in every pair: past its margin (0.91) but not clearly (0.61) —
    # three pairs like that come by chance where steps vary by ±50%. A second trial at once, and
    # the typical pair of the six decides
    plan = dense_incumbent(fp32=0.006)
    modes = steps(plan, 30, lambda mode, step: {FP32: 0.006, FP16: 0.005}[mode])
    trial = [FP16, FP32] * TRIAL_PAIRS + [FP32]  # the last step: while its last report travels
    assert modes[:2 * len(trial)] == trial + trial
    assert set(modes[2 * len(trial):]) == {FP16} and plan.trials.incumbent == FP16


def test_a_win_within_a_steps_noise_does_not_overturn_what_earlier_trials_measured():
    # fp16 and fp32 compared side by side before, fp16 1.1x fp32's steps in twelve pairs; now one
    # trial's three pairs happen to favour fp16 (0.8 of fp32's step): not clear, and the typical pair
    # of the window still says fp32
    plan = dense_incumbent(fp32=0.006)
    plan.trials.pair_ratios[(FP32, FP16)] = deque([1 / 1.1] * PAIR_WINDOW, maxlen=PAIR_WINDOW)  # fp32 over fp16
    plan.trials.last_trial = {FP16: plan.step - MIN_REEXPLORE, FP32: plan.step - MIN_REEXPLORE}
    modes = steps(plan, 2 * TRIAL_PAIRS + 3, lambda mode, step: {FP32: 0.006, FP16: 0.0048}[mode])
    assert modes[:2 * TRIAL_PAIRS] == [FP16, FP32] * TRIAL_PAIRS
    assert set(modes[2 * TRIAL_PAIRS:]) == {FP32} and plan.trials.incumbent == FP32


def test_a_close_call_is_decided_by_the_pairs_of_two_trials_not_one():
    # fp16's steps over fp32's (6 ms): 0.85, 0.95, 0.80 in the first trial — not every pair beats
    # the 1/1.1 margin, most do: a second trial at once, 0.85, 0.88, 0.93, and the typical pair of
    # the six does
    ratios = itertools.chain((0.85, 0.95, 0.80, 0.85, 0.88, 0.93), itertools.repeat(0.88))
    halves = (0.006 * ratio for ratio in ratios)
    plan = dense_incumbent(fp32=0.006)
    modes = steps(plan, 2 * (2 * TRIAL_PAIRS + 1) + 5, lambda mode, step: next(halves) if mode == FP16 else 0.006)
    trial = [FP16, FP32] * TRIAL_PAIRS + [FP32]  # the last step: while its last report travels
    assert modes[:2 * len(trial)] == trial + trial
    assert set(modes[2 * len(trial):]) == {FP16}


def test_a_first_trial_split_by_one_stalled_step_runs_again_at_once_and_both_decide():
    # fp16 at 0.6 of fp32's 6 ms, but its second step stalled (1.2): not every pair won, most did.
    # Rather than fp32 for MIN_REEXPLORE steps, a second trial follows, and the typical pair of the
    # six (0.6) makes fp16 the incumbent
    halves = itertools.chain((0.0036, 0.0072), itertools.repeat(0.0036))
    plan = dense_incumbent(fp32=0.006)
    modes = steps(plan, 30, lambda mode, step: next(halves) if mode == FP16 else 0.006)
    first = [FP16, FP32] * TRIAL_PAIRS
    assert modes[:2 * len(first) + 2] == first + [FP32] + first + [FP32]
    assert set(modes[2 * len(first) + 2:]) == {FP16} and plan.trials.incumbent == FP16


def test_a_challenger_that_lost_most_pairs_of_its_first_trial_waits_its_turn():
    halves = itertools.chain((0.0036, 0.0072, 0.0072), itertools.repeat(0.0036))
    plan = dense_incumbent(fp32=0.006)
    modes = steps(plan, MIN_REEXPLORE, lambda mode, step: next(halves) if mode == FP16 else 0.006)
    assert modes[:2 * TRIAL_PAIRS] == [FP16, FP32] * TRIAL_PAIRS
    assert set(modes[2 * TRIAL_PAIRS:]) == {FP32} and plan.trials.rematch is None


def test_a_slow_spell_hits_both_modes_of_a_trial_alike_and_a_stale_measurement_does_not_decide():
    # fp32 was measured during a slow spell (12 ms a step); the machine is fast again: fp32 6 ms,
    # fp16 6.3 ms (6.9 with its margin). fp16 is predicted from the stale fp32 at 10 ms: worth a
    # trial, and the trial, whose steps alternate, keeps fp32
    plan = dense_incumbent(fp32=0.012)
    modes = steps(plan, MIN_REEXPLORE, lambda mode, step: {FP32: 0.006, FP16: 0.0063}[mode])
    assert modes[:2 * TRIAL_PAIRS] == [FP16, FP32] * TRIAL_PAIRS
    assert set(modes[2 * TRIAL_PAIRS:]) == {FP32} and plan.trials.incumbent == FP32


def test_a_challenger_is_tried_again_once_its_trial_costs_a_small_share_of_the_time_since():
    plan = dense_incumbent(fp32=0.006)
    # fp16 costs 0.93 ms more a step with its margin: a trial's three fp16 steps are due after
    # 3 * 0.93 / (2% of 6 ms) = 23 steps, so every MIN_REEXPLORE steps; sparse (57 ms with its
    # margin) after 3 * 51 / 0.12 = 1,280 steps
    modes = steps(plan, 200, lambda mode, step: {FP32: 0.006, FP16: 0.0063, SPARSE: 0.050}[mode])
    assert modes[:2 * TRIAL_PAIRS] == [FP16, FP32] * TRIAL_PAIRS  # fp16's first trial, at once
    starts = [0] + [step for step in range(2, len(modes)) if modes[step - 2:step + 1] == [FP32, FP32, FP16]]
    gaps = {later - earlier for earlier, later in zip(starts, starts[1:], strict=False)}
    # a trial is 6 steps, decided 2 steps after its last: the next starts MIN_REEXPLORE steps later
    assert gaps == {2 * TRIAL_PAIRS + 1 + MIN_REEXPLORE}
    assert SPARSE not in modes


def test_a_challenger_that_lost_side_by_side_waits_in_proportion_to_what_its_trials_measured():
    # fp16's steps alone look nearly as cheap as fp32's (6.3 ms against 6: its next trial due every
    # MIN_REEXPLORE steps by that), but side by side, in its trials, each took twice the fp32 step
    # after it: its next trial comes once 3 x (2 - 1) steps' worth is 2% of the steps since, 150
    plan = dense_incumbent(fp32=0.006)
    plan.trials.pair_ratios[(FP32, FP16)] = deque([0.5] * 2 * TRIAL_PAIRS, maxlen=PAIR_WINDOW)  # fp32 over fp16
    plan.trials.last_trial = {FP16: plan.step, FP32: plan.step}
    modes = steps(plan, 200, lambda mode, step: {FP32: 0.006, FP16: 0.0063}[mode])
    assert 145 <= modes.index(FP16) <= 151


def test_an_unlucky_first_measurement_is_tried_again_and_corrected():
    # no probe steps: trials alone; the first steps saw the link at a tenth of its speed: dense
    # predicted at 41 ms, sparse costs 2 ms (2.2 with its margin)
    plan = measured(budget(probe=0), sparse=0.002, compute=0.001, throughput=100e6, per_nnz=2.0, magnitude=1e5)
    modes = steps(plan, 3000, lambda mode, step: {FP32: 0.001, SPARSE: 0.003}[mode])
    first = modes.index(FP32)
    assert first <= TRIAL_PAIRS * 0.039 / (EXPLORE_SHARE * 0.0022) + 1
    # the trial (1 ms against 3.3 ms) makes fp32 the incumbent once its last report is in
    decided = first + 2 * TRIAL_PAIRS + 1
    assert modes[first:decided] == [FP32, SPARSE] * TRIAL_PAIRS + [SPARSE]
    assert set(modes[decided:decided + MIN_REEXPLORE]) == {FP32}


def test_a_dense_modes_cost_is_its_whole_step_so_compute_it_slowed_counts_against_it():
    plan = budget(probe=0)
    for _ in range(5):  # past the warm-up steps
        next_plan(plan)
    plan.current = Plan(FP16)
    # an fp16 step whose collective waited 1 ms but slowed the backward to 6 ms (gloo's fp16 sums
    # share the processor with it): 7 ms
    plan.measuring = StepMeasurement(forward_start=0.0, last_submit=0.0065, last_done=0.0075, local_s=0.0005)
    assert plan.end_step().fp16_step_s == pytest.approx(0.0075)
    # against it, an fp32 step not yet run: 3 ms of compute and 4 MB at 1 GB/s
    plan.observe(report(compute=0.003, throughput=1e9, fp16=0.0075, per_nnz=2.0, magnitude=1.0))
    for _ in range(COST_WINDOW):
        plan.observe(report(sparse=0.050))
    assert next_plan(plan).mode == FP32


def test_on_a_fast_link_fp16_predicted_cheapest_runs_from_the_start_without_waiting_for_fp32():
    # fp32 predicted at 2 + 4 ms, fp16 at 2 + 2 ms (4.4 with its margin), sparse at 6.1 ms with its
    # margin: fp16 is the first incumbent, before any fp32 step is timed. Its steps take 4 ms,
    # fp32's would take 6: fp32's trial waits in proportion (3 x 0.36 / 2% of the steps: 54), then
    # sparse's (3 x 0.39 / 2%: 58), and both lose
    plan = measured(budget(probe=0), sparse=0.00304, compute=0.002, throughput=1e9, per_nnz=2.0, magnitude=1.0)
    costs = {FP32: 0.006, FP16: 0.004, SPARSE: 0.0061}
    modes = steps(plan, 90, lambda mode, step: costs[mode])
    first_trial = modes.index(FP32)
    assert 50 <= first_trial <= 56 and set(modes[:first_trial]) == {FP16}
    assert modes[first_trial:first_trial + 2 * TRIAL_PAIRS] == [FP32, FP16] * TRIAL_PAIRS  # the likeliest first
    assert first_trial < modes.index(SPARSE) and modes[-10:] == [FP16] * 10 and plan.trials.incumbent == FP16


def test_an_fp16_all_reduce_probed_no_faster_than_fp32s_leaves_fp32_the_first_incumbent():
    # the fast link above, but its fp16 all_reduce probed at half fp32's wire bytes per second
    # (gloo sums fp16 on the processor): fp16's 2 MB take as long as fp32's 4, fp16 is predicted at
    # fp32's 6 ms (6.6 with its margin), and fp32 runs first. fp16's trial waits for its predicted
    # extra cost (3 x 0.1 / 2% of the steps: 15), and measured no cheaper it never takes over (nor
    # does sparse, tried in between)
    plan = budget(probe=0)
    plan.costs.observe_link(1e9, 0.5e9)
    plan = measured(plan, sparse=0.00304, compute=0.002, throughput=1e9, per_nnz=2.0, magnitude=1.0)
    modes = steps(plan, 90, lambda mode, step: {FP32: 0.006, FP16: 0.006, SPARSE: 0.0061}[mode])
    first_trial = modes.index(FP16)
    assert modes[0] == FP32 and 12 <= first_trial <= 18
    assert modes[first_trial:first_trial + 2 * TRIAL_PAIRS] == [FP16, FP32] * TRIAL_PAIRS
    assert FP16 not in modes[:first_trial] and plan.trials.incumbent == FP32
    assert modes.count(FP32) > 0.8 * len(modes)  # trials aside, fp32 throughout


@pytest.mark.parametrize("sparse, wins", [(0.0034, False), (0.0030, True)])
def test_sparse_must_save_its_margin_over_fp16_as_over_fp32(sparse, wins):
    # the fast link above, fp16 the incumbent at 4 ms a step: sparse steps 2.5% cheaper side by side
    # (0.975 of fp16's) are not worth what they hold back in the feedback; 12.5% cheaper (0.875) are,
    # once two trials agree
    plan = measured(budget(probe=0), sparse=0.00304, compute=0.002, throughput=1e9, per_nnz=2.0, magnitude=1.0)
    modes = steps(plan, 120, lambda mode, step: {FP32: 0.006, FP16: 0.004, SPARSE: sparse}[mode])
    assert modes[0] == FP16 and plan.trials.incumbent == (SPARSE if wins else FP16)


def test_fp16_run_first_but_slower_side_by_side_than_fp32_gives_way_after_fp32s_trial():
    # a fast link: fp16 predicted at 1.5 + 1 ms (x1.1) against fp32's 1.5 + 2 ms, so fp16 runs first;
    # but its steps take 6 ms (gloo sums fp16 on the processor that runs the backward), fp32's 3.5:
    # measured, fp16 is dearer than fp32 is predicted, fp32's trial comes at once, and it wins
    plan = measured(budget(probe=0), sparse=0.050, compute=0.0015, throughput=2e9, per_nnz=2.0, magnitude=1.0)
    modes = steps(plan, 40, lambda mode, step: {FP16: 0.006, FP32: 0.0035}[mode])
    assert modes[0] == FP16
    first_trial = modes.index(FP32)
    assert first_trial <= WARMUP_STEPS + 4  # once fp16's first timed steps are reported
    assert modes[first_trial:first_trial + 2 * TRIAL_PAIRS] == [FP32, FP16] * TRIAL_PAIRS
    decided = first_trial + 2 * TRIAL_PAIRS + 1
    assert set(modes[decided:]) == {FP32} and plan.trials.incumbent == FP32


def test_a_step_in_another_mode_than_the_step_before_is_flagged_so_that_its_cost_is_reported():
    plan = measured(budget(), sparse=0.050, compute=0.002, throughput=1e9, fp32=0.006, fp16=0.005, per_nnz=2.0,
                    magnitude=1.0)
    modes, switched = [], []
    for _ in range(3 * MIN_REEXPLORE):
        modes.append(next_plan(plan).mode)
        switched.append(plan.switched)
    assert FP32 in modes and FP16 in modes
    assert switched[1:] == [now != before for before, now in zip(modes, modes[1:], strict=False)]


def test_a_user_set_budget_decides_by_bytes_alone_and_never_probes():
    for bytes_, expected in [(DENSE_BYTES, FP32), (DENSE_BYTES // 2, FP16), (20_000, SPARSE)]:
        plan = budget(budget=bytes_)
        next_plan(plan)
        plan.observe(report(per_nnz=2.0, magnitude=1.0))
        modes = {next_plan(plan).mode for _ in range(250)}
        assert modes == {expected}, bytes_


def test_before_the_first_step_a_user_budget_below_fp16s_bytes_plans_sparse_and_a_larger_one_dense():
    for bytes_, expected in [(20_000, Plan(SPARSE, 0.001)), (DENSE_BYTES // 2, Plan(FP32)),
                             (DENSE_BYTES, Plan(FP32))]:
        plan = Planner(Adaptive(budget=bytes_), world_size=2)
        plan.costs.total_numel = N  # the model's size, as the reducer tells it; what the budget covers: not yet known
        assert plan.begin_step(now=0.0) == expected, bytes_


def test_the_plan_follows_the_slowest_compute_and_step_and_the_link_as_the_last_rank_to_post_timed_it():
    # rank two posted its all_reduce first and waited for rank one's: its time holds that wait
    one = report(compute=0.001, throughput=20e6, fp32=0.2, sparse=0.004)
    two = report(compute=0.003, throughput=10e6, fp32=0.5, sparse=0.005)
    plan = budget()
    every_rank = torch.tensor([one.numbers(), two.numbers()], dtype=torch.float64)
    plan.observe(Report.agreed(every_rank))  # what every rank makes of every rank's report
    costs = plan.costs
    assert costs.compute_s[-1] == 0.003 and costs.throughput[-1] == 20e6 and costs.fp32_step_s[-1] == 0.5
    assert costs.sparse_overhead_s[-1] == pytest.approx(0.002)  # the slowest sparse step beyond the slowest compute


def test_a_report_from_an_older_checkpoint_adds_no_throughput():
    # an older checkpoint held the throughput negated (MAX took the least), +inf unmeasured
    plan = budget()
    for old in (-20e6, math.inf):
        plan.observe(Report.from_numbers([0.003, old, 0.5, 0, 0, 0, 0, 0, 0, 0, 0]))
    assert not plan.costs.throughput and list(plan.costs.compute_s) == [0.003, 0.003]


def test_a_modes_cost_is_the_mean_of_its_middle_steps_blind_to_a_rare_slow_one():
    plan = measured(budget(probe=0), sparse=0.050, compute=0.002, throughput=1e9, per_nnz=2.0, magnitude=1e5)
    for cost in (0.0030, 0.0031, 0.0029, 0.0300, 0.0030, 0.0032, 0.0028, 0.0030):
        plan.observe(report(fp32=cost))
    assert typical(plan.costs.fp32_step_s) == pytest.approx(0.0030, abs=5e-5)


def test_a_modes_first_few_steps_cost_their_median_so_one_hiccup_does_not_put_off_its_next_trial():
    # fp16's first trial: 5 ms steps but one stalled at 30 ms. As a mean, fp16 would cost 13.3 ms
    # and (against fp32's 6 ms, with its 10% margin) be tried again only ~220 steps later; as their
    # median, 5 ms
    assert typical(deque([0.005, 0.030, 0.005])) == 0.005
    assert typical(deque([0.004, 0.006])) == pytest.approx(0.005)


def test_the_budget_state_round_trips_through_a_checkpoint():
    plan = budget()
    next_plan(plan)
    for cost in (0.003, 0.004):
        next_plan(plan, report(compute=0.002, throughput=10e6, fp32=0.4, sparse=cost, per_nnz=2.0, magnitude=3.0,
                               preferred=0.01))
    restored = budget()
    restored.load_state_dict(plan.state_dict())
    assert restored.state_dict() == plan.state_dict()
    assert next_plan(restored) == next_plan(plan)


def test_a_trial_under_way_and_the_pairs_compared_round_trip_through_a_checkpoint():
    plan = dense_incumbent(fp32=0.006)
    steps(plan, 2 * TRIAL_PAIRS + 1 + MIN_REEXPLORE + 2, lambda mode, step: {FP32: 0.006, FP16: 0.0058}[mode])
    assert plan.trials.trial is not None and plan.trials.pair_ratios  # the second trial is under way
    restored = budget(probe=0)
    restored.load_state_dict(plan.state_dict())
    assert restored.state_dict() == plan.state_dict()
    cost = lambda mode, step: {FP32: 0.006, FP16: 0.0052}[mode]  # noqa: E731
    assert steps(restored, 20, cost) == steps(plan, 20, cost)
