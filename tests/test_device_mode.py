"""``adaptive``'s sparse steps on either route: the pipeline's own codecs (`Mode.SPARSE`) or the
device route in its device form (`Mode.DEVICE`, `sparsecomm.device.support.device_form`). Which
pipelines have one, where the planner weighs it, how its trials decide, and that a run whose steps
move between the routes keeps every entry of the gradient and resumes bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import sparsecomm as sc
from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.adaptive.planner import Planner
from sparsecomm.adaptive.report import Report
from sparsecomm.components import Adaptive
from sparsecomm.device.support import device_form
from sparsecomm.encode.index.packed import PackedIndices
from sparsecomm.launch import run_local
from sparsecomm.pipeline import Segment
from sparsecomm.presets import resolve
from sparsecomm.reducer.call import Route
from sparsecomm.reducer.checkpoint import FORMAT, migrate
from sparsecomm.reducer.config import ReducerConfig
from test_link_budget import TRIAL_PAIRS, WARMUP_STEPS, N, budget, measured, next_plan
from test_training import batches, digest, mlp

FP32, FP16, SPARSE, DEVICE = Mode.FP32, Mode.FP16, Mode.SPARSE, Mode.DEVICE
SPEC = "adaptive(device_route=any)+residual+rice+fp32+allgather"
"""lossless values on both routes: what a step does not send stays in the residual, exactly"""


@pytest.mark.parametrize("preset", ["adaptive", "dgc"])
def test_a_pipeline_on_the_host_codecs_has_a_device_form_with_packed_indices(preset):
    spec = resolve(preset)
    form = device_form(spec)
    assert form is not None and form.index_codec == PackedIndices()
    assert (form.sparsifier, form.feedback, form.value_codec, form.transport) == (
        spec.sparsifier, spec.feedback, spec.value_codec, spec.transport)


def test_a_pipeline_without_a_device_form_says_so():
    for spec in ("adaptive(device_route=never)+residual+rice+int8+allgather",  # the user said no
                 "adaptive+residual+rice+qsgd+allgather",  # values without a device form
                 "adaptive+residual+rice+fp32+sparse_allreduce",  # a transport without one
                 "adaptive+residual+packed+int8+allgather",  # the device route's own: always on it
                 "topk(ratio=0.01)+residual+rice+fp32+allgather"):  # a sparsifier without one
        assert device_form(resolve(spec)) is None, spec
    with pytest.raises(sc.SparseCommError, match="device_route"):
        resolve("adaptive(device_route=gpu)+residual+rice+int8+allgather")


def test_gpus_take_dgcs_device_form_in_place_of_rle_only():
    assert ReducerConfig(resolve("dgc")).gpus_take_device_form
    for spec in ("adaptive", "dgc(ratio=0.001)+dgc_momentum(momentum=0.9)+packed+fp32+allgather",
                 "dgc(ratio=0.001)+dgc_momentum(momentum=0.9)+rice+fp32+allgather",
                 "dgc(ratio=0.001)+dgc_momentum(momentum=0.9,clip=1.0)+rle+fp32+allgather", "sparcml"):
        # adaptive's trials weigh the routes; the device route's own; an entropy codec sends fewer bytes
        # than packed; local clipping has no device form; nor SparCML's sparsifier
        assert not ReducerConfig(resolve(spec)).gpus_take_device_form, spec


# -- the planner ---------------------------------------------------------------------------------

def sparse_incumbent(route: str = "any", **settings) -> Planner:
    """A slow link on which sparse steps on the codecs were chosen and measured, past the warm-up,
    for a pipeline with a device form."""
    plan = measured(budget(probe=0, device_route=route, **settings), sparse=0.010, compute=0.002,
                    throughput=12.5e6, per_nnz=2.0, magnitude=1.0)
    plan.device_form = True
    while plan.step <= WARMUP_STEPS:
        next_plan(plan)
    return plan


def routed_steps(plan: Planner, count: int, cost: dict[Mode, float], host_memory: bool = False) -> list[Mode]:
    """``count`` steps as the reducer runs them, each step's report heard two steps later: a
    step costs ``cost[mode]`` beyond its payloads' wire time."""
    modes, pending = [], []
    for _ in range(count):
        while pending and pending[0][0] <= plan.step - 2:
            plan.observe(*reversed(pending.pop(0)))
        chosen = next_plan(plan)
        modes.append(chosen.mode)
        pending.append((plan.step - 1, Report(compute_s=0.002, sparse_step_s=cost[chosen.mode], bytes_per_nnz=2.0,
                                              device_route=float(chosen.mode is DEVICE),
                                              host_memory=float(host_memory))))
    return modes


@pytest.mark.parametrize("device_cost, wins", [(0.003, True), (0.012, False)])
def test_the_device_route_runs_next_to_the_codecs_and_replaces_them_only_where_it_is_faster(device_cost, wins):
    plan = sparse_incumbent()
    plan.observe(Report(compute_s=0.002, host_memory=0.0))
    modes = routed_steps(plan, 24, {SPARSE: 0.010, DEVICE: device_cost})
    # one untimed step to warm the route up, then the trial's pairs, the challenger first
    assert modes[:1 + 2 * TRIAL_PAIRS] == [DEVICE] + [DEVICE, SPARSE] * TRIAL_PAIRS
    assert set(modes[2 + 2 * TRIAL_PAIRS:]) == {DEVICE if wins else SPARSE}
    assert plan.trials.incumbent == (DEVICE if wins else SPARSE)
    # both routes plan the same density: a trial compares their time, not what they send
    assert plan.costs.predicted(1e6, device=True)[DEVICE][1].density == plan.costs.predicted(1e6)[SPARSE][1].density


def test_a_trial_of_the_device_route_under_way_round_trips_through_a_checkpoint():
    plan, costs = sparse_incumbent(), {SPARSE: 0.010, DEVICE: 0.003}
    routed_steps(plan, 3, costs)  # the warm-up step and the trial's first pair
    assert plan.trials.trial is not None and plan.trials.trial.challenger is DEVICE
    resumed = budget(probe=0, device_route="any")
    resumed.device_form = True
    resumed.load_state_dict(copy.deepcopy(plan.state_dict()))
    going_on = routed_steps(plan, 12, costs)
    assert routed_steps(resumed, 12, costs) == going_on and DEVICE in going_on
    assert resumed.trials.state_dict() == plan.trials.state_dict()


def test_by_default_the_device_route_is_weighed_only_while_every_ranks_gradients_are_off_the_host():
    fresh = budget(device_route="accelerator")
    fresh.device_form = True
    assert not fresh.device_weighed()  # no report heard yet: as on the host
    plan = sparse_incumbent(route="accelerator")  # its reports: a GPU's gradients
    assert plan.device_weighed()
    routed_steps(plan, 4, {SPARSE: 0.010, DEVICE: 0.001}, host_memory=True)  # one rank's on the host (heard 2 steps on)
    assert not plan.device_weighed()
    assert set(routed_steps(plan, 16, {SPARSE: 0.010, DEVICE: 0.001}, host_memory=True)) == {SPARSE}
    assert DEVICE in routed_steps(plan, 16, {SPARSE: 0.010, DEVICE: 0.001})
    assert plan.device_weighed()


def test_the_device_route_is_never_weighed_under_a_users_byte_budget_or_without_a_device_form():
    user = budget(budget=20_000, device_route="any")
    user.device_form = True
    assert not user.device_weighed()
    assert {next_plan(user).mode for _ in range(12)} == {SPARSE}
    plan = sparse_incumbent()
    plan.suit(resolve("adaptive(device_route=never)+residual+rice+int8+allgather"))
    assert not plan.device_weighed()
    plan.suit(resolve("adaptive(device_route=any)+residual+rice+int8+allgather"))
    assert plan.device_weighed()


# -- a reducer whose steps move between the routes ----------------------------------------------

PLANS = [Plan(SPARSE, 0.05), Plan(DEVICE, 0.05), Plan(DEVICE, 0.02), Plan(FP32), Plan(DEVICE, 0.05), Plan(FP16),
         Plan(SPARSE, 0.02), Plan(DEVICE, 0.05), Plan(FP32), Plan(SPARSE, 0.05)]


def reducer_of(plans: list[Plan], start: int) -> sc.GradientReducer:
    reducer = sc.GradientReducer(SPEC, seed=5)
    scripted = iter(plans[start:])
    reducer.adaptive.planner.plan = lambda: next(scripted)  # every rank plans the same
    return reducer


def moving(rank: int, world: int, resume_at: int | None, device: str = "cpu") -> tuple[str, float, list[str]]:
    """`PLANS`' steps of a custom loop: the model's digest, how far the sums applied plus what the
    ranks' residuals hold are from the sum of every rank's gradients (0 with nothing lost), and
    the route each step's largest tensor took."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = mlp(0).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reducer = reducer_of(PLANS, 0)
    applied = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    given = copy.deepcopy(applied)
    routes = []
    for step, (data, labels) in enumerate(batches(rank, world, len(PLANS))):
        if step == resume_at:
            saved = copy.deepcopy(reducer.state_dict())
            reducer.close()
            reducer = reducer_of(PLANS, step)
            reducer.load_state_dict(saved)
        optimizer.zero_grad()
        F.cross_entropy(model(data.to(device)), labels.to(device)).backward()
        for name, p in model.named_parameters():
            given[name] += p.grad
        reducer.allreduce_((name, p.grad) for name, p in model.named_parameters())
        for name, p in model.named_parameters():
            applied[name] += p.grad
        optimizer.step()
        routes.append(reducer.stats.tensors["2.weight"].route)
    missing = 0.0
    for name, total in given.items():
        state = reducer.pipeline.states.get(name)  # none: a small tensor, always on the plain route
        held = state.feedback.get("residual") if state is not None else None
        kept = held.reshape(total.shape) if held is not None else torch.zeros_like(total)
        both = torch.stack([total, kept])
        torch.distributed.all_reduce(both)
        missing = max(missing, float((applied[name] + both[1] / world - both[0] / world).abs().max()))
    reducer.close()
    return digest(model.cpu()), missing, routes


def test_steps_that_move_between_the_codecs_and_the_device_route_lose_nothing_and_resume_bit_for_bit():
    straight = run_local(2, moving, None)
    resumed = run_local(2, moving, 4)
    (model, missing, routes), (other, _, _) = straight
    assert model == other and straight == resumed
    assert routes == ["compressed", "device", "device", "dense step", "device", "dense step", "compressed",
                      "device", "dense step", "compressed"]
    assert missing < 1e-5, missing


def device_buckets(rank: int, world: int, spec: str) -> list[dict[str, int]]:
    """DDP's steps moving between the routes: after each device step, the identity of each bucket's
    fixed parts on the device route, and whether they send entries whole (the biases: their codec's
    error and momentum then live there too)."""
    model = DistributedDataParallel(mlp(0))
    plans = [Plan(SPARSE, 0.05), Plan(DEVICE, 0.05), Plan(SPARSE, 0.05), Plan(DEVICE, 0.05), Plan(FP32),
             Plan(DEVICE, 0.05), Plan(FP16), Plan(SPARSE, 0.02), Plan(DEVICE, 0.02)]
    reducer = sc.register_ddp_hook(model, spec, seed=5)
    scripted = iter(plans)
    reducer.adaptive.planner.plan = lambda: next(scripted)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for plan, (data, labels) in zip(plans, batches(rank, world, len(plans)), strict=True):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
        if plan.mode is DEVICE:
            buckets = reducer.runtime.paths[Route.DEVICE]._buckets
            seen.append({key: id(bucket) for key, bucket in buckets.items()}
                        | {"whole": int(all(b.layout.whole is not None for b in buckets.values()))})
    reducer.close()
    return seen


@pytest.mark.parametrize("feedback", ["residual", "dgc_momentum(masking=false,nesterov=true)"])
def test_a_device_step_after_steps_on_the_codecs_or_dense_ones_finds_its_bucket_as_it_left_it(feedback):
    """The other routes keep the device route's buffers as their own state, in place (the feedback,
    the momentum and the value codec's error of the entries sent whole), so moving between the
    routes rebuilds nothing: a trial between them times what each costs in a run of its own."""
    for seen in run_local(2, device_buckets, f"adaptive(device_route=any)+{feedback}+rice+int8+allgather"):
        assert len(seen) == 4 and seen[0]["whole"] == 1
        assert all(each == seen[0] for each in seen), seen


def conserved(rank: int, world: int) -> float:
    """A bucket of a matrix and a vector sent whole, int8 values, steps moving between the routes
    and dense ones: how far the sums returned plus what the ranks hold (the residual, and the
    codec's error of the vector) are from the sum of every rank's gradients."""
    segments = (Segment("w", 0, 3000), Segment("b", 3000, 40, whole=True))
    plans = [Plan(SPARSE, 0.05), Plan(DEVICE, 0.05), Plan(SPARSE, 0.05), Plan(DEVICE, 0.05), Plan(FP32),
             Plan(DEVICE, 0.05), Plan(FP32), Plan(SPARSE, 0.02), Plan(DEVICE, 0.02), Plan(SPARSE, 0.05)]
    reducer = sc.GradientReducer("adaptive(device_route=any)+residual+rice+int8+allgather", seed=5)
    scripted = iter(plans)
    reducer.adaptive.planner.plan = lambda: next(scripted)
    generator = torch.Generator().manual_seed(rank)
    given, returned = torch.zeros(3040), torch.zeros(3040)
    for _ in plans:
        gradient = torch.randn(3040, generator=generator)
        given += gradient
        future = reducer.reduce_flat_async("bucket", gradient.clone(), segments, last=True)
        reducer.finish_step()
        returned += future.wait()
    states = reducer.pipeline.states
    codec_error = states["b"].codec_error
    held = torch.cat([states["w"].feedback["residual"].reshape(-1),
                      codec_error if codec_error is not None else torch.zeros(40)])
    both = torch.stack([given, held])
    torch.distributed.all_reduce(both)
    reducer.close()
    return float((returned + both[1] / world - both[0] / world).abs().max())


def test_moving_between_the_routes_and_dense_steps_loses_nothing_of_the_entries_sent_whole():
    """What the int8 codec rounds off the vector is held whichever route rounded it, and goes with
    the next step on any route."""
    assert max(run_local(2, conserved)) < 1e-4


def test_a_format_1_checkpoint_starts_the_device_routes_costs_unmeasured():
    plan = sparse_incumbent()
    state = {"format": 1, "adaptive": {"planner": plan.state_dict(), "reports": {}}}
    costs = state["adaptive"]["planner"]["costs"]
    for key in ("device_overhead_s", "device_bytes_per_nnz", "device_fixed_bytes", "host_memory"):
        del costs[key]
    migrated = migrate(state)
    assert migrated["format"] == FORMAT
    fresh = Planner(Adaptive(), world_size=2)
    fresh.costs.total_numel = N
    fresh.load_state_dict(migrated["adaptive"]["planner"])
    assert not fresh.costs.device_overhead_s and fresh.costs.host_memory == 1.0
    assert fresh.costs.sparse_overhead_s == plan.costs.sparse_overhead_s


def non_finite_after_codecs(rank: int, world: int, policy: str) -> dict:
    """A device step after one on the codecs, rank 1's gradient holding a NaN: what each rank
    raised, whether its residual was kept as it was or took in the step's gradient, and the
    model's digest after two more steps."""
    model = mlp(0)
    plans = [Plan(SPARSE, 0.05), Plan(DEVICE, 0.05), Plan(DEVICE, 0.05), Plan(SPARSE, 0.05)]
    reducer = sc.GradientReducer(SPEC, seed=5, nonfinite=policy)
    scripted = iter(plans)
    reducer.adaptive.planner.plan = lambda: next(scripted)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    outcome, kept, took_in = "ok", None, None
    for step, (data, labels) in enumerate(batches(rank, world, len(plans))):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        if step == 1 and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        before = None
        if step == 1:  # in the shape the codecs kept it
            before = reducer.pipeline.states["0.weight"].feedback["residual"].reshape(-1).clone()
            gradient = model[0].weight.grad.reshape(-1).clone()
        try:
            reducer.allreduce_((n, p.grad) for n, p in model.named_parameters())
            optimizer.step()
        except sc.SparseCommError as error:
            outcome = str(error)
        if before is not None:
            after = reducer.pipeline.states["0.weight"].feedback["residual"].reshape(-1)
            kept = torch.equal(before, after)
            took_in = torch.allclose(before + gradient, after, atol=1e-6)
    reducer.close()
    return {"outcome": outcome, "kept": kept, "took_in": took_in, "digest": digest(model)}


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_non_finite_gradient_on_the_device_route_after_the_codecs_loses_nothing_and_keeps_the_ranks_alike(policy):
    first, second = run_local(2, non_finite_after_codecs, policy, timeout=120)
    assert first["digest"] == second["digest"]  # every rank went on alike
    if policy == "raise":  # the finite rank holds its gradient for a later step; the other keeps its residual
        assert "non-finite" in first["outcome"] and "non-finite" in second["outcome"]
        assert first["took_in"] and not first["kept"] and second["kept"]
    else:
        assert first["outcome"] == second["outcome"] == "ok"
        assert second["kept"] and not first["kept"]  # only the rank with the NaN keeps its residual
