"""The device route end to end on 2 gloo ranks: DDP and custom loops train through it with ranks
alike, its buffer has the size its capacity says, a checkpoint resumes bit for bit (and reads the
same as the host path's), a non-finite gradient keeps every state, and its host syncs per step do
not grow with the number of tensors."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.bench.op_counts import count_ops
from sparsecomm.device.wire import HEADER
from sparsecomm.launch import run_local
from sparsecomm.pipeline import Segment
from test_training import batches, digest, full_loss, mlp

DEVICE_SPEC = "dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+raw+fp32+allgather"
HOST_SPEC = "dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+rle+fp32+allgather"
ADAPTIVE_SPEC = "adaptive(budget=20000)+residual+packed+int8+allgather"


def buffer_bytes(model: nn.Module, ratio: float) -> int:
    """The device route's bytes per step for ``model`` in one bucket (raw indices, fp32 values): the
    header's words, an index and a value per selected entry — ceil(ratio·numel) of each matrix — and
    a value per entry of each vector, sent whole."""
    selected = sum(math.ceil(ratio * p.numel()) for p in model.parameters() if p.dim() > 1)
    whole = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    return 4 * (HEADER + 2 * selected + whole)


def train(rank: int, world: int, spec: str, steps: int) -> dict:
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, spec, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for data, labels in batches(rank, world, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
    routes = {stats.route for stats in reducer.stats.tensors.values()}
    reducer.close()
    return {"loss": full_loss(model), "digest": digest(model), "routes": routes,
            "bytes": reducer.stats.summary()["bytes_sent"]}


def test_ddp_trains_through_the_device_route_with_ranks_alike_and_the_bytes_its_capacity_says():
    steps = 60
    device = run_local(2, train, DEVICE_SPEC, steps)
    host = run_local(2, train, HOST_SPEC, steps)
    assert device[0]["routes"] == {"device"} and host[0]["routes"] == {"compressed"}
    assert device[0]["digest"] == device[1]["digest"]
    initial = full_loss(mlp(0))
    assert device[0]["loss"] < 0.5 * initial
    assert device[0]["loss"] <= host[0]["loss"] + 0.15, (device[0]["loss"], host[0]["loss"])
    assert device[0]["bytes"] == steps * buffer_bytes(mlp(0), 0.01)


def train_with_gradients_on(rank: int, world: int, accelerated: tuple[int, ...], spec: str, steps: int) -> dict:
    """`train`, with the ranks in ``accelerated`` taking their gradients for an accelerator's."""
    from sparsecomm.reducer import runtime

    here = rank in accelerated
    runtime.on_gpu = lambda tensor: here
    return train(rank, world, spec, steps)


def test_dgc_takes_its_device_form_only_where_every_ranks_gradients_are_on_an_accelerator():
    """There its codecs' copies and reads of the device would cost per tensor: the preset's calls
    take its device form (packed indices in place of rle), as the spec that names it does."""
    steps = 12
    accelerated = run_local(2, train_with_gradients_on, (0, 1), "dgc", steps)
    named = run_local(2, train, "dgc(ratio=0.001)+dgc_momentum(momentum=0.9)+packed+fp32+allgather", steps)
    assert accelerated[0]["routes"] == named[0]["routes"] == {"device"}
    assert accelerated[0]["digest"] == accelerated[1]["digest"] == named[0]["digest"]
    assert accelerated[0]["bytes"] == named[0]["bytes"]
    one_of_two = run_local(2, train_with_gradients_on, (0,), "dgc", steps)  # the ranks agree: the codecs
    on_host = run_local(2, train, "dgc", steps)
    assert one_of_two[0]["routes"] == one_of_two[1]["routes"] == on_host[0]["routes"] == {"compressed"}
    assert one_of_two[0]["digest"] == one_of_two[1]["digest"] == on_host[0]["digest"]


@pytest.mark.parametrize("codecs", ["packed+fp16", "packed+int8"])
def test_packed_indices_and_narrow_values_train_as_raw_fp32_does_in_fewer_bytes(codecs):
    steps = 60
    narrow = run_local(2, train, DEVICE_SPEC.replace("raw+fp32", codecs), steps)
    assert narrow[0]["routes"] == {"device"} and narrow[0]["digest"] == narrow[1]["digest"]
    assert narrow[0]["loss"] < 0.5 * full_loss(mlp(0))
    assert narrow[0]["bytes"] < 0.8 * steps * buffer_bytes(mlp(0), 0.01)


def train_manual(rank: int, world: int, specs: tuple[str, str], steps: int, resume_at: int | None) -> str:
    model = mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reducer = sc.GradientReducer(specs[0], seed=3)
    for step, (data, labels) in enumerate(batches(rank, world, steps)):
        if step == resume_at:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "reducer": reducer.state_dict()}
            reducer.close()
            model = mlp(99)
            model.load_state_dict(saved["model"])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            reducer = sc.GradientReducer(specs[1], seed=3)
            state = saved["reducer"]
            if specs[1] != specs[0]:  # the same per-parameter state under another pipeline's name
                state["pipeline"]["spec"] = reducer.state_dict()["pipeline"]["spec"]
            reducer.load_state_dict(state)
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        reducer.allreduce_((n, p.grad) for n, p in model.named_parameters())
        optimizer.step()
    reducer.close()
    return digest(model)


def test_a_custom_loop_on_the_device_route_resumes_bit_identically_from_a_checkpoint():
    straight = run_local(2, train_manual, (DEVICE_SPEC, DEVICE_SPEC), 10, None)
    resumed = run_local(2, train_manual, (DEVICE_SPEC, DEVICE_SPEC), 10, 5)
    assert straight[0] == straight[1] == resumed[0] == resumed[1]


def shared_out(rank: int, world: int, spec: str, steps: int, resume_at: int | None) -> tuple[str, dict[str, float]]:
    """`train_manual` under ``adaptive``, every step sparse on the device route (a byte budget, or
    the plans scripted): the parameters, and each one's share of the density."""
    def reducer_of() -> sc.GradientReducer:
        reducer = sc.GradientReducer(spec, seed=3)
        if "budget" not in spec:  # every rank plans the same sparse steps
            reducer.adaptive.planner.plan = lambda: Plan(Mode.SPARSE, 0.02)
        return reducer

    model = mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reducer = reducer_of()
    for step, (data, labels) in enumerate(batches(rank, world, steps)):
        if step == resume_at:
            saved = copy.deepcopy(reducer.state_dict())
            reducer.close()
            reducer = reducer_of()
            reducer.load_state_dict(saved)
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        reducer.allreduce_((n, p.grad) for n, p in model.named_parameters())
        optimizer.step()
    on_device = {key for key, stats in reducer.stats.tensors.items() if stats.route == "device"}
    shares = {key: state.density_share for key, state in reducer.pipeline.states.items() if key in on_device}
    reducer.close()
    assert shares, reducer.stats.tensors
    return digest(model), shares


@pytest.mark.parametrize("spec", [ADAPTIVE_SPEC, ADAPTIVE_SPEC.replace("(budget=20000)", "")])
def test_adaptive_on_the_device_route_shares_its_density_out_and_resumes_bit_identically(spec):
    """Each parameter's share of the density (`sparsecomm.device.shares`) is held in its checkpointed
    state: a resumed run goes on exactly as the straight one. Without a byte budget the ranks agree
    on it (it sizes every rank's buffer); within one, each keeps its own."""
    straight = run_local(2, shared_out, spec, 12, None)
    resumed = run_local(2, shared_out, spec, 12, 6)
    assert straight == resumed and straight[0][0] == straight[1][0]
    for _, shares in straight:
        assert len(set(shares.values())) == 1 and 1.0 < min(shares.values()) <= 2.0, shares  # one bucket, one share
    if "budget" not in spec:
        assert straight[0][1] == straight[1][1]


def disagreeing_shares(rank: int, world: int) -> list[float]:
    """A checkpoint whose shares differ by rank (as the host path's may) loaded on the device route
    without a byte budget: the ranks make them one before their buffers' sizes depend on them."""
    reducer = sc.GradientReducer(ADAPTIVE_SPEC.replace("(budget=20000)", ""), seed=3)
    reducer.adaptive.planner.plan = lambda: Plan(Mode.SPARSE, 0.02)
    model = mlp(0)
    steps = list(batches(rank, world, 4))
    for step, (data, labels) in enumerate(steps):
        if step == 2:
            saved = copy.deepcopy(reducer.state_dict())
            for state in saved["pipeline"]["tensors"].values():
                state["density_share"] = 1.0 + 0.5 * rank
            reducer.load_state_dict(saved)
        model.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        reducer.allreduce_((n, p.grad) for n, p in model.named_parameters())
    shares = [state.density_share for state in reducer.pipeline.states.values()]
    reducer.close()
    return shares


def test_shares_that_differ_by_rank_are_made_one_before_they_size_a_buffer():
    first, second = run_local(2, disagreeing_shares, timeout=120)
    assert first == second


def test_the_device_routes_checkpoint_is_the_host_paths_state_by_name():
    """The host path's state, loaded into a reducer on the device route, goes on from where it was:
    the same momentum by name, so the run differs from a host-only run only in what it selects."""
    host_then_device = run_local(2, train_manual, (HOST_SPEC, DEVICE_SPEC), 10, 5)
    device_fresh = run_local(2, train_manual, (HOST_SPEC, DEVICE_SPEC), 10, 0)  # nothing carried over
    assert host_then_device[0] == host_then_device[1]
    assert host_then_device[0] != device_fresh[0]


def nonfinite_step(rank: int, world: int, policy: str) -> dict:
    """Rank 1's gradient holds a NaN at the second step: what each rank raised, whether its DGC
    momentum state stayed as it was, took in the step's gradient (b ← 0.9·b + g, v ← v + b) or
    the step of a zero gradient (b ← 0.9·b, v ← v + b), and whether it is finite."""
    model = mlp(0)
    reducer = sc.GradientReducer(DEVICE_SPEC, nonfinite=policy)
    outcome, before, after, gradient = "ok", None, None, None
    for step, (data, labels) in enumerate(batches(rank, world, 3)):
        model.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        if step == 1:
            if rank == 1:
                model[0].weight.grad[0, 0] = float("nan")
            before = {k: v.clone() for k, v in reducer.pipeline.states["0.weight"].feedback.items()
                      if isinstance(v, torch.Tensor)}
            gradient = model[0].weight.grad.clone()
        try:
            reducer.allreduce_((n, p.grad) for n, p in model.named_parameters())
        except sc.SparseCommError as err:
            outcome = str(err)
        if step == 1:
            after = {k: v.clone() for k, v in reducer.pipeline.states["0.weight"].feedback.items()
                     if isinstance(v, torch.Tensor)}
        if outcome != "ok":
            break
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    reducer.close()
    kept = all(torch.equal(before[k], after[k]) for k in before)
    flat_before, flat_after = ({k: v.reshape(-1) for k, v in state.items()} for state in (before, after))
    momentum = 0.9 * flat_before["momentum_buffer"] + gradient.reshape(-1)
    took_in = (torch.allclose(flat_after["momentum_buffer"], momentum, atol=1e-6)
               and torch.allclose(flat_after["accumulated"], flat_before["accumulated"] + momentum, atol=1e-6))
    decayed = 0.9 * flat_before["momentum_buffer"]
    idled = (torch.allclose(flat_after["momentum_buffer"], decayed, atol=1e-6)
             and torch.allclose(flat_after["accumulated"], flat_before["accumulated"] + decayed, atol=1e-6))
    finite = all(bool(torch.isfinite(v).all()) for v in after.values())
    return {"outcome": outcome, "kept": kept, "took_in": took_in, "idled": idled, "finite": finite}


@pytest.mark.parametrize("policy", ["raise", "skip", "zero"])
def test_a_non_finite_gradient_on_the_device_route_loses_nothing_and_raises_on_every_rank(policy):
    results = run_local(2, nonfinite_step, policy, timeout=120)
    assert all(r["finite"] for r in results)
    if policy == "raise":  # the finite rank holds its gradient for a later step, the other a zero's step
        assert all("non-finite gradient" in r["outcome"] for r in results)
        assert results[0]["took_in"] and results[1]["idled"]
    else:
        assert all(r["outcome"] == "ok" for r in results)
    if policy == "skip":  # the rank with the NaN takes a zero gradient's step, as the host path's does
        assert results[1]["idled"] and not results[0]["kept"]


def train_half(rank: int, world: int, spec: str, dtype: torch.dtype, steps: int) -> dict:
    model = DDP(mlp(0).to(dtype))
    reducer = sc.register_ddp_hook(model, spec, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data, labels = next(batches(0, 1, 1, batch=256))

    def loss() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(data.to(dtype)).float(), labels))

    before = loss()
    for batch, targets in batches(rank, world, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(batch.to(dtype)).float(), targets).backward()
        optimizer.step()
    routes = {stats.route for stats in reducer.stats.tensors.values()}
    reducer.close()
    return {"before": before, "after": loss(), "routes": routes,
            "weights": [p.detach().float() for p in model.parameters()]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codecs", ["packed+int8", "packed+bf16"])
def test_half_precision_gradients_train_through_the_device_routes_lossy_codecs(dtype, codecs):
    """The codecs take fp32 values; the feedback keeps the gradient's own dtype. The run tracks the
    same run in fp32."""
    spec = DEVICE_SPEC.replace("raw+fp32", codecs)
    results = run_local(2, train_half, spec, dtype, 20)
    reference = run_local(2, train_half, spec, torch.float32, 20)[0]
    assert results[0]["routes"] == {"device"}
    assert all(torch.equal(a, b) for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True))
    assert all(bool(torch.isfinite(w).all()) for w in results[0]["weights"])
    assert results[0]["after"] < reference["before"] - 0.2, (results[0]["after"], reference)
    assert results[0]["after"] == pytest.approx(reference["after"], abs=0.02)


def deep_mlp(layers: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(*[module for _ in range(layers) for module in (nn.Linear(64, 64), nn.ReLU())])


def syncs_per_step(rank: int, world: int, layers: int, spec: str) -> tuple[float, float]:
    model = DDP(deep_mlp(layers), bucket_cap_mb=100)
    sc.register_ddp_hook(model, spec)
    data = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model.zero_grad()
        model(data).square().mean().backward()

    for _ in range(3):  # DDP rebuilds its buckets after the first step
        step()
    counts = count_ops(step, 5)
    return counts.syncs, counts.ops


@pytest.mark.parametrize("spec", [DEVICE_SPEC, DEVICE_SPEC.replace("raw+fp32", "packed+int8"),
                                  ADAPTIVE_SPEC.replace("20000", "30000")])
def test_host_syncs_per_step_on_the_device_route_do_not_grow_with_the_number_of_tensors(spec):
    few = run_local(2, syncs_per_step, 6, spec)  # 12 tensors
    many = run_local(2, syncs_per_step, 24, spec)  # 48 tensors
    assert few[0][0] == many[0][0] == 1, (few, many)  # one bucket, one read


def syncs_of_sampling_steps(rank: int, world: int) -> tuple[list[float], bool]:
    model = DDP(deep_mlp(6), bucket_cap_mb=100)
    # no budget: every 4th sparse step samples the gradient's energy, and its last call computes the
    # density that energy prefers
    reducer = sc.register_ddp_hook(model, "adaptive(device_route=any)+dgc_momentum(masking=false,nesterov=true)"
                                          "+packed+int8+allgather")
    reducer.adaptive.planner.plan = lambda: Plan(Mode.DEVICE, 0.05)
    data = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model.zero_grad()
        model(data).square().mean().backward()

    for _ in range(6):  # DDP's bucket rebuild, and the costs the preference needs
        step()
    syncs = [count_ops(step, 1).syncs for _ in range(4)]
    costs = reducer.adaptive.planner.costs
    reducer.close()
    return syncs, bool(costs.compute_s and costs.throughput)


def test_a_step_that_weighs_the_gradients_energy_on_the_device_route_reads_the_device_once_too():
    for syncs, measured in run_local(2, syncs_of_sampling_steps):
        assert measured  # the preferred density is computed, not skipped for want of costs
        assert syncs == [1.0] * 4, syncs  # one bucket, one read, the sampling step's included


def syncs_of_dense_steps(rank: int, world: int, mode: Mode) -> tuple[list[float], float]:
    model = DDP(deep_mlp(6), bucket_cap_mb=100)
    reducer = sc.register_ddp_hook(model, "adaptive")
    reducer.adaptive.planner.plan = lambda: Plan(mode)
    data = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model.zero_grad()
        model(data).square().mean().backward()

    step()  # DDP rebuilds its buckets after the first step
    syncs = [count_ops(step, 1).syncs for _ in range(4)]  # the first steps: each one reports
    magnitude = reducer.adaptive.planner.costs.max_magnitude
    reducer.close()
    return syncs, magnitude


@pytest.mark.parametrize("mode", [Mode.FP32, Mode.FP16])
def test_a_dense_step_reads_the_device_once_per_bucket_with_the_magnitude_the_planner_hears(mode):
    """The sum's check and the largest magnitude sent (which keeps fp16 steps in range) in one read."""
    for syncs, magnitude in run_local(2, syncs_of_dense_steps, mode):
        assert syncs == [1.0] * 4, syncs  # one bucket, one read
        assert 0 < magnitude < math.inf


def train_budgeted(rank: int, world: int, spec: str, steps: int) -> dict:
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, spec, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sent = []
    for data, labels in batches(rank, world, steps):
        optimizer.zero_grad()
        before = reducer.stats.summary()["bytes_sent"]
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
        sent.append(reducer.stats.summary()["bytes_sent"] - before)
    routes = {stats.route for stats in reducer.stats.tensors.values()}
    modes = dict(reducer.adaptive.planner.mode_steps)
    reducer.close()
    return {"loss": full_loss(model), "digest": digest(model), "routes": routes, "sent": sent, "modes": modes}


def test_adaptive_sparse_steps_take_the_device_route_and_send_their_byte_budget_to_the_byte():
    results = run_local(2, train_budgeted, ADAPTIVE_SPEC, 40)
    host = run_local(2, train_budgeted, ADAPTIVE_SPEC.replace("packed", "rice"), 40)[0]
    first = results[0]
    assert first["routes"] == {"device"} and first["digest"] == results[1]["digest"]
    assert set(first["modes"]) == {Mode.SPARSE}
    # as far as the host path at the same budget (which buys it more entries: see the docs' routing page)
    assert first["loss"] < 0.92 * full_loss(mlp(0)) and first["loss"] < host["loss"] + 0.05, (first, host)
    # a fixed-size buffer per density: once the planner knows its bytes per entry, each step's bytes
    # are the budget's, within an entry's
    assert all(abs(sent - 20_000) <= 8 for sent in first["sent"][10:]), first["sent"]


def rewound(rank: int, world: int) -> list[bool]:
    """A live reducer that loads an earlier checkpoint goes on as a fresh one that loads it does."""
    spec = DEVICE_SPEC.replace("raw+fp32", "packed+int8")  # with the whole entries' momentum and codec error
    segments = (Segment("w", 0, 5000), Segment("b", 5000, 10, whole=True))
    generator = torch.Generator().manual_seed(rank)
    gradients = [torch.randn(5010, generator=generator) for _ in range(12)]

    def reduce(reducer: sc.GradientReducer, gradient: torch.Tensor) -> torch.Tensor:
        future = reducer.reduce_flat_async("bucket", gradient.clone(), segments, last=True)
        reducer.finish_step()
        return future.wait()

    live = sc.GradientReducer(spec, seed=3)
    for gradient in gradients[:5]:
        reduce(live, gradient)
    saved = copy.deepcopy(live.state_dict())
    for gradient in gradients[5:8]:
        reduce(live, gradient)
    live.load_state_dict(copy.deepcopy(saved))
    after_load = [reduce(live, gradient) for gradient in gradients[8:]]
    fresh = sc.GradientReducer(spec, seed=3)
    fresh.load_state_dict(saved)
    again = [reduce(fresh, gradient) for gradient in gradients[8:]]
    live.close()
    fresh.close()
    return [torch.equal(a, b) for a, b in zip(after_load, again, strict=True)]


def test_a_checkpoint_loaded_into_a_running_reducer_replaces_the_device_routes_buffers():
    assert all(all(same) for same in run_local(2, rewound))


def switching(rank: int, world: int) -> list[float]:
    """Dense, sparse, sparse, dense steps of adaptive with DGC's momentum on the device route: what
    each parameter's momentum held after each step (its accumulated v, summed over parameters)."""
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, "adaptive(dense_start=1)+dgc_momentum(masking=false,nesterov=true)+packed"
                                          "+int8+allgather", seed=1)
    plans = iter([Plan(Mode.FP32), Plan(Mode.SPARSE, 0.01), Plan(Mode.SPARSE, 0.01), Plan(Mode.FP32)])
    reducer.adaptive.planner.plan = lambda: next(plans)  # the steps scripted, on every rank alike
    held = []
    for data, labels in batches(rank, world, 4):
        F.cross_entropy(model(data), labels).backward()
        held.append(sum(float(state.feedback["accumulated"].abs().sum())
                        for state in reducer.pipeline.states.values() if "accumulated" in state.feedback))
        model.zero_grad()
    reducer.close()
    return held


def test_a_dense_step_after_sparse_ones_on_the_device_route_sends_what_their_momentum_held():
    """DGC's momentum is the ranks' common one after a dense step; the sparse steps that follow make
    it each rank's own again, so the next dense step sends what they held back and empties it."""
    held = run_local(2, switching)[0]
    assert held[0] == 0 and held[1] > 0 and held[2] > 0 and held[3] == 0, held


def laid_out_anew(rank: int, world: int, sizes: tuple[int, int]) -> tuple[dict, dict, dict, str]:
    """One stream whose two parameters swap places (and, with other sizes, whose buffer shrinks)
    halfway: what each parameter fed, was given and holds."""
    names = ("p0", "p1")
    fed = {name: torch.zeros(size, dtype=torch.float64) for name, size in zip(names, sizes, strict=True)}
    given = {name: torch.zeros_like(total) for name, total in fed.items()}
    with sc.GradientReducer("dgc(ratio=0.01)+residual+raw+fp32+allgather", seed=1, dense_below=0,
                            average=False) as reducer:
        for step in range(6):
            order = names if step < 3 else names[::-1]
            segments, start = [], 0
            for name in order:
                segments.append(Segment(name, start, fed[name].numel()))
                start += fed[name].numel()
            gradient = torch.randn(start, generator=torch.Generator().manual_seed(100 * rank + step))
            average = reducer.reduce("bucket", gradient.clone(), tuple(segments))
            for segment in segments:
                span = slice(segment.start, segment.start + segment.numel)
                fed[segment.key] += gradient[span].double()
                given[segment.key] += average[span].double()
        held = {name: reducer.pipeline.states[name].feedback["residual"].double().reshape(-1) for name in names}
        route = reducer.stats.tensors["bucket"].route
    dist.all_reduce(fed["p0"]), dist.all_reduce(fed["p1"])
    dist.all_reduce(held["p0"]), dist.all_reduce(held["p1"])
    return fed, given, held, route


def test_a_stream_laid_out_anew_keeps_each_parameters_state_by_name_on_the_device_route():
    """A custom loop may lay a stream's parameters out otherwise (another order, a parameter gone):
    the route rebuilds the bucket from the states by name, and nothing goes to the wrong one."""
    fed, given, held, route = run_local(2, laid_out_anew, (100, 4900))[0]
    assert route == "device"
    for name in ("p0", "p1"):
        assert float((fed[name] - given[name] - held[name]).abs().max()) < 1e-4, name
