"""Compression under FSDP2 (`register_fsdp_hooks`). Hybrid: FSDP shards inside each node,
sparsecomm averages each shard across nodes (four gloo ranks stand for two nodes of two ranks).
Flat: each module's reduce-scatter sends each owner its range's largest entries. Both keep every
rank alike and checkpoint each rank's state through torch.distributed.checkpoint."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

import sparsecomm as sc
from helpers import adaptive_at_once
from sparsecomm.launch import run_local


def layers(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 3))


def sharded(mesh) -> torch.nn.Sequential:
    """The layers, each sharded over ``mesh``, and the root."""
    model = layers()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank: int, number: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * number + rank))


def full(tensors) -> torch.Tensor:
    return torch.cat([t.full_tensor().reshape(-1) for t in tensors])


def hybrid(rank: int, world: int, spec: str, tmp: str) -> dict:
    mesh = sc.Topology(2).device_mesh("cpu")
    model = sharded(mesh["node"])
    compression = sc.register_fsdp_hooks(model, spec, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = layers()
    for number in range(3):
        with torch.no_grad():  # the reference starts every step where the sharded model is
            for mine, theirs in zip(reference.parameters(), model.parameters(), strict=True):
                mine.copy_(theirs.full_tensor())
        optimizer.zero_grad()
        model(batch(rank, number)).square().mean().backward()
        if spec == "dense":  # every rank's gradient averaged over all four, as DDP would
            reference.zero_grad()
            reference(batch(rank, number)).square().mean().backward()
            expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
            dist.all_reduce(expected)
            torch.testing.assert_close(full(p.grad for p in model.parameters()), expected / world)
        optimizer.step()
    params = full(p for p in model.parameters())
    everyone = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(everyone, params)
    assert all(torch.equal(everyone[0], other) for other in everyone)
    numel = sum(p.numel() for p in layers().parameters())
    assert compression.stats.steps == 3
    assert compression.stats.dense_bytes == pytest.approx(3 * 4 * numel / 2, rel=0.05)
    saved = copy.deepcopy(compression.state_dict())
    dcp.save({"compression": compression.for_checkpoint()}, checkpoint_id=f"{tmp}/{spec}")
    fresh = sc.register_fsdp_hooks(sharded(mesh["node"]), spec, mesh)
    dcp.load({"compression": fresh.for_checkpoint()}, checkpoint_id=f"{tmp}/{spec}")
    assert same(fresh.state_dict(), saved)  # every rank its own
    with pytest.raises(sc.SparseCommError, match="mesh"):
        compression.load_state_dict({**saved, "mesh": [4, 1]})
    compression.close()
    fresh.close()

    # a NaN on one rank in one shard's rows reaches one group across nodes: every rank raises
    broken = sharded(mesh["node"])
    sc.register_fsdp_hooks(broken, spec, mesh)

    def poison(module, inputs, output):  # the first unit's gradient, on rank 3: row 0 of the first layer
        if rank == 3:
            output.register_hook(lambda grad: grad.index_fill(1, torch.tensor([0]), float("nan")))

    broken[0].register_forward_hook(poison)
    with pytest.raises(sc.SparseCommError, match="non-finite|another rank of this node"):
        broken(batch(rank, 9)).square().mean().backward()
    return {"ratio": compression.stats.compression_ratio}


def same(a, b) -> bool:
    """Whether two states hold the same values (tensors bit for bit)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize(("spec", "least_ratio"), [
    ("dense", 1.0), ("topk(ratio=0.05)+residual+rice+fp32", 8.0),  # top 5% in 32-bit values
    (adaptive_at_once(), 1.0),  # its dense steps flush modules whose every parameter goes whole
])
def test_fsdp_inside_nodes_and_a_pipeline_between_them_keep_every_rank_alike(spec, least_ratio, tmp_path):
    ratios = [result["ratio"] for result in run_local(4, hybrid, spec, str(tmp_path))]
    assert all(ratio == 1.0 if spec == "dense" else ratio >= least_ratio for ratio in ratios)


def flat(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    # every entry of every range: FSDP's own average, to rounding
    exact, plain = sharded(mesh), sharded(mesh)
    sc.register_fsdp_hooks(exact, "topk(ratio=1.0)+residual+raw+fp32", mesh)
    for model in (exact, plain):
        model(batch(rank, 0)).square().mean().backward()
    torch.testing.assert_close(full(p.grad for p in exact.parameters()), full(p.grad for p in plain.parameters()))

    # a tenth of each range in fp16: the ranks stay alike, what is held back is kept, never a NaN
    model = sharded(mesh)
    compression = sc.register_fsdp_hooks(model, "topk(ratio=0.1)+residual+raw+fp16", mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for number in range(3):
        optimizer.zero_grad()
        model(batch(rank, number)).square().mean().backward()
        optimizer.step()
    params = full(p for p in model.parameters())
    everyone = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(everyone, params)
    assert all(torch.equal(everyone[0], other) for other in everyone)
    assert compression.stats.steps == 3 and compression.stats.compression_ratio > 3  # counted as the modules call
    saved = copy.deepcopy(compression.state_dict())
    assert all(r.abs().sum() > 0 for r in saved["residuals"].values())  # the other 90% is held back
    dcp.save({"compression": compression.for_checkpoint()}, checkpoint_id=f"{tmp}/flat")
    fresh = sc.register_fsdp_hooks(sharded(mesh), "topk(ratio=0.1)+residual+raw+fp16", mesh)
    dcp.load({"compression": fresh.for_checkpoint()}, checkpoint_id=f"{tmp}/flat")
    assert same(fresh.state_dict(), saved)  # every rank its own
    with torch.no_grad():
        next(iter(model.parameters())).to_local().fill_(float("nan"))
    model(batch(rank, 3)).square().mean().backward()
    assert all(torch.isfinite(comm.residual).all() for comm in compression.comms.values())
    with pytest.raises(sc.SparseCommError, match="FSDP modules"):
        compression.load_state_dict({**saved, "residuals": {}})
    with pytest.raises(sc.SparseCommError, match="topk"):
        sc.register_fsdp_hooks(sharded(mesh), "dgc", mesh)
    with pytest.raises(sc.SparseCommError, match="no other transport"):  # rice would not be used: refused
        sc.register_fsdp_hooks(sharded(mesh), "topk(ratio=0.1)+residual+rice+fp32", mesh)
    return {"ratio": compression.stats.compression_ratio}


def test_over_one_flat_group_each_owner_gets_only_its_ranges_largest_entries(tmp_path):
    ratios = [result["ratio"] for result in run_local(2, flat, str(tmp_path))]
    assert ratios[0] == ratios[1]


def refused(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = sc.Topology(1).device_mesh("cpu")
    with pytest.raises(sc.SparseCommError, match="no FSDP module"):
        sc.register_fsdp_hooks(layers(), "dense", mesh)
    other = init_device_mesh("cpu", (world, 1), mesh_dim_names=("a", "b"))
    with pytest.raises(sc.SparseCommError, match="dimensions"):
        sc.register_fsdp_hooks(sharded(other["b"]), "dense", other)


def test_a_model_without_fsdp_modules_or_a_mesh_of_other_dimensions_is_refused():
    run_local(2, refused)


def transformer_rows(rank: int, world: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    from sparsecomm.train import sharded
    from sparsecomm.train.workloads import workload

    task = workload("gpt")
    model = sharded.shard(task.model(0), init_device_mesh("cpu", (world,)))  # its blocks sit in a ModuleList
    batch = next(iter(task.batches(rank, world, 1, 2, 0)))
    task.loss(model, batch).backward()
    return sum(1 for module in model.modules() if hasattr(module, "set_all_reduce_hook"))


def test_the_train_jobs_fsdp_rows_shard_each_block_of_a_transformer():
    assert run_local(2, transformer_rows)[0] == 9  # its 8 blocks, and the root with the (tied) embeddings


def frozen(rank: int, world: int) -> dict:
    """Two nodes of one rank: a frozen bias, then a layer frozen whole, then the bias trained again."""
    mesh = sc.Topology(1).device_mesh("cpu")
    model, reference = sharded(mesh["node"]), layers()
    model[0].bias.requires_grad_(False)
    compression = sc.register_fsdp_hooks(model, "dense", mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for number in range(4):
        if number == 1:
            for parameter in model[2].parameters():
                parameter.requires_grad_(False)
        if number == 3:
            model[0].bias.requires_grad_(True)
        with torch.no_grad():
            for mine, theirs in zip(reference.parameters(), model.parameters(), strict=True):
                mine.copy_(theirs.full_tensor())
        optimizer.zero_grad()
        model(batch(rank, number)).square().mean().backward()
        reference.zero_grad()
        reference(batch(rank, number)).square().mean().backward()
        for mine, theirs in zip(reference.parameters(), model.parameters(), strict=True):
            if theirs.requires_grad:  # DDP's average over both ranks, as FSDP with HSDP would give
                expected = mine.grad.clone()
                dist.all_reduce(expected)
                torch.testing.assert_close(theirs.grad.full_tensor(), expected / world)
            else:
                assert theirs.grad is None
        optimizer.step()
        steps.append(compression.stats.steps)
    compression.finish_step()  # the step ended with its last module: nothing more to end
    assert compression.stats.steps == 4
    compression.close()

    # a parameter that requires a gradient gets none: the error says so
    two = Branches()
    fully_shard(two, mesh=mesh["node"])
    sc.register_fsdp_hooks(two, "dense", mesh)
    with pytest.raises(sc.SparseCommError, match="got none this step"):
        two(torch.randn(4, 8), False).square().mean().backward()
    return {"steps": steps}


class Branches(torch.nn.Module):
    """A weight, and a bias only one branch adds."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8, 8))
        self.bias = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor, biased: bool) -> torch.Tensor:
        return x @ self.weight + self.bias if biased else x @ self.weight


def test_hybrid_fsdp_reduces_only_the_parameters_that_require_a_gradient_and_counts_steps_by_them():
    for result in run_local(2, frozen):
        assert result["steps"] == [1, 2, 3, 4]  # each step ends when every module that reduces has reported


def half_reduced(rank: int, world: int) -> list[torch.dtype]:
    """Gradients reduced in bf16 (FSDP's mixed precision): what each path holds back is fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    kept = []
    for mesh in (init_device_mesh("cpu", (world,)), sc.Topology(1).device_mesh("cpu")):
        model = layers()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh if mesh.ndim == 1 else mesh["node"], mp_policy=policy)
        fully_shard(model, mesh=mesh if mesh.ndim == 1 else mesh["node"], mp_policy=policy)
        compression = sc.register_fsdp_hooks(model, "topk(ratio=0.1)+residual+raw+bf16", mesh)
        model(batch(rank, 0)).square().mean().backward()
        if mesh.ndim == 1:
            kept += [comm.residual.dtype for comm in compression.comms.values()]
        else:
            kept += [state.feedback["residual"].dtype for state in compression.across.pipeline.states.values()
                     if "residual" in state.feedback]
        compression.close()
    return kept


def test_a_gradient_reduced_in_half_precision_is_held_back_in_fp32():
    for kept in run_local(2, half_reduced):
        assert kept and set(kept) == {torch.float32}, kept


def flat_refrozen(rank: int, world: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = sharded(mesh)
    sc.register_fsdp_hooks(model, "topk(ratio=0.1)+residual+raw+fp32", mesh)
    model(batch(rank, 0)).square().mean().backward()
    model[0].bias.requires_grad_(False)
    with pytest.warns(UserWarning, match="dropped"):
        model(batch(rank, 1)).square().mean().backward()
    return True


class Twins(torch.nn.Module):
    """Two weights of one shape, either of which the step trains."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(8, 8))
        self.b = torch.nn.Parameter(torch.zeros(8, 8))

    def forward(self, x: torch.Tensor, trained: str) -> torch.Tensor:
        return (x * getattr(self, trained)).sum()


def flat_swapped(rank: int, world: int) -> float:
    """a trained, then b with a zero gradient: the same layout's size, another parameter in it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = Twins()
    fully_shard(model, mesh=mesh)
    sc.register_fsdp_hooks(model, "topk(ratio=0.1)+residual+raw+fp32", mesh)
    model.b.requires_grad_(False)
    model(torch.arange(64.0).view(8, 8) / 64 + 1, "a").backward()  # most of a's gradient held back
    model.a.requires_grad_(False)
    model.b.requires_grad_(True)
    with pytest.warns(UserWarning, match="dropped"):
        model(torch.zeros(8, 8), "b").backward()
    return float(model.b.grad.full_tensor().abs().sum())


def test_a_flat_fsdp_module_whose_layout_changes_says_what_it_drops():
    assert all(run_local(2, flat_refrozen))
    assert run_local(2, flat_swapped) == [0.0, 0.0]  # a's held-back error never arrives as b's gradient


def flat_linear(mesh, spec: str, rows: int = 64):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, rows)
    fully_shard(model, mesh=mesh)
    return model, sc.register_fsdp_hooks(model, spec, mesh)


def flat_state_kept_apart(rank: int, world: int) -> list[bool]:
    """A flat compression's state_dict is a copy, and so is what load_state_dict took in."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, compression = flat_linear(mesh, "topk(ratio=0.1)+residual+raw+fp32")
    model(batch(rank, 0)[:, :1].repeat(1, 256)).sum().backward()
    state = compression.state_dict()
    saved = copy.deepcopy(state)
    model(batch(rank, 1)[:, :1].repeat(1, 256)).sum().backward()
    resumed, taken = flat_linear(mesh, "topk(ratio=0.1)+residual+raw+fp32")
    given = copy.deepcopy(saved)
    taken.load_state_dict(given)
    resumed(batch(rank, 2)[:, :1].repeat(1, 256)).sum().backward()
    return [torch.equal(state["residuals"]["<root>"], saved["residuals"]["<root>"]),
            torch.equal(given["residuals"]["<root>"], saved["residuals"]["<root>"])]


def flat_fp16_beyond_range(rank: int, world: int) -> tuple[bool, bool, float]:
    """A finite gradient beyond fp16's range: sent at fp16's bound, the excess held back."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, compression = flat_linear(mesh, "topk(ratio=0.1)+residual+raw+fp16")
    (model(torch.ones(4, 256)).sum() * 1e5).backward()  # the bias's gradient: 4e5 in every entry
    shard = model.bias.grad.to_local()
    residual = compression.comms["<root>"].residual
    return bool(torch.isfinite(shard).all()), bool(torch.isfinite(residual).all()), float(residual.abs().max())


def test_a_flat_compressions_state_is_copied_out_and_in_and_fp16_keeps_what_it_cannot_carry():
    assert run_local(2, flat_state_kept_apart) == [[True, True]] * 2
    for finite_sum, finite_held, largest_held in run_local(2, flat_fp16_beyond_range):
        assert finite_sum and finite_held
        assert largest_held >= 4e5 - 65504 - 1  # the entries sent held back all beyond fp16's bound


def flat_mismatched(rank: int, world: int, specs: tuple[str, str]) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        flat_linear(init_device_mesh("cpu", (world,)), specs[rank])
        return "registered"
    except sc.SparseCommError as err:
        return str(err)


def flat_resharded(rank: int, world: int, reduced_first: bool) -> str:
    """A checkpoint of a (64, 256) layer loaded into a (32, 256) one of the same module name."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, compression = flat_linear(mesh, "topk(ratio=0.1)+residual+raw+fp32")
    model(torch.ones(4, 256)).sum().backward()
    other, loading = flat_linear(mesh, "topk(ratio=0.1)+residual+raw+fp32", rows=32)
    try:
        if reduced_first:
            other(torch.ones(4, 256)).sum().backward()
        loading.load_state_dict(compression.state_dict())
        other(torch.ones(4, 256)).sum().backward()
        return "loaded"
    except sc.SparseCommError as err:
        return str(err)


def test_flat_compressions_that_differ_across_ranks_or_from_their_checkpoint_are_refused():
    for outcome in run_local(2, flat_mismatched, ("topk(ratio=0.1)+residual+raw+fp32",
                                                  "topk(ratio=0.2)+residual+raw+fp32")):
        assert "ranks disagree" in outcome and "FlatFSDPCompression configuration" in outcome, outcome
    for reduced_first in (False, True):
        for outcome in run_local(2, flat_resharded, reduced_first):
            assert "is laid out as (2, 8224)" in outcome and "resume with the same sharding" in outcome, outcome
