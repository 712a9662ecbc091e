"""Hierarchical reduction: dense inside each node, compressed between nodes (`HierarchicalReducer`).

Four ranks stand for two nodes of two ranks. A lossless pipeline gives DDP's average; a node of one
rank is a flat `GradientReducer`, bit for bit; a lossy one keeps every rank's gradients equal while
only each rank's shard crosses between nodes; a checkpoint resumes bit for bit, and only on its own
topology."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from helpers import outcome
from sparsecomm.launch import run_local
from sparsecomm.pipeline import Segment
from sparsecomm.reducer.node_shards import NodeShards

LOSSY = "topk(ratio=0.05)+residual+rice+fp32"


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 3))


def gradients(ddp: DDP, rank: int, number: int) -> list[torch.Tensor]:
    data = torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 * number + rank))
    ddp.zero_grad()
    ddp(data).square().mean().backward()
    return [p.grad.clone() for p in ddp.parameters()]


def gathered(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's flattened ``tensors``."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def two_nodes(rank: int, world: int) -> dict[str, float]:
    topology = sc.Topology(2)
    # lossless: DDP's own average (to rounding: the sums run in another order)
    plain, hierarchical = DDP(model()), DDP(model())
    sc.register_ddp_hook(hierarchical, "dense", topology=topology)
    for number in range(2):
        for mine, ddps in zip(gradients(hierarchical, rank, number), gradients(plain, rank, number), strict=True):
            torch.testing.assert_close(mine, ddps, rtol=1e-5, atol=1e-7)

    # a custom loop, tensors of 1 to 6,144 elements: one buffer, every slice owned once
    with sc.HierarchicalReducer("dense", topology) as reducer:
        named = [("a", torch.full((1,), float(rank))), ("b", torch.arange(7.0) * rank), ("c", torch.randn(96, 64))]
        expected = [sum(t for t in gathered([tensor])) / world for _, tensor in named]
        reducer.allreduce_(named)
        for (_, tensor), mean in zip(named, expected, strict=True):
            torch.testing.assert_close(tensor.reshape(-1), mean)

    # one non-finite entry on one rank reaches one shard's ranks across nodes: every rank raises
    with sc.HierarchicalReducer(LOSSY, topology) as reducer:
        gradient = torch.randn(96, 64)
        gradient[0, 0] = float("nan") if rank == 3 else 0.0
        with pytest.raises(sc.SparseCommError, match="non-finite|another rank of this node"):
            reducer.allreduce_([("c", gradient)])

    # lossy: the ranks agree; each rank sends its half of the model between nodes
    lossy = DDP(model())
    reducer = sc.register_ddp_hook(lossy, LOSSY, topology=topology)
    for number in range(3):
        gradients(lossy, rank, number)
        first, *others = gathered([p.grad for p in lossy.parameters()])
        assert all(torch.equal(first, other) for other in others)
    numel = sum(p.numel() for p in lossy.parameters())
    assert reducer.stats.dense_bytes == pytest.approx(3 * 4 * numel / 2, rel=0.01)
    assert reducer.stats.compression_ratio > 3 and reducer.node_bytes > 0
    reducer.close()
    return {"nodes": reducer.groups.nodes, "local": reducer.groups.local_rank}


def test_two_nodes_of_two_ranks_average_as_ddp_and_agree():
    places = run_local(4, two_nodes)
    assert [(p["nodes"], p["local"]) for p in places] == [(2, 0), (2, 1), (2, 0), (2, 1)]


def resume_and_flat(rank: int, world: int, tmp: str) -> None:
    # a node of one rank is the flat reducer, bit for bit
    flat, one_rank_nodes = DDP(model()), DDP(model())
    flat_reducer = sc.register_ddp_hook(flat, LOSSY)
    sc.register_ddp_hook(one_rank_nodes, LOSSY, topology=sc.Topology(1))
    for number in range(3):
        for a, b in zip(gradients(flat, rank, number), gradients(one_rank_nodes, rank, number), strict=True):
            assert torch.equal(a, b)
    flat_reducer.close()

    # a resumed run continues bit for bit; another topology is refused
    going = DDP(model())
    reducer = sc.register_ddp_hook(going, "dgc", topology=sc.Topology(2))
    for number in range(2):
        gradients(going, rank, number)
    torch.save(reducer.state_dict(), f"{tmp}/reducer-{rank}.pt")
    resumed = DDP(model())
    resumed.load_state_dict(going.state_dict())
    again = sc.HierarchicalReducer("dgc", sc.Topology(2), model=resumed)
    again.load_state_dict(torch.load(f"{tmp}/reducer-{rank}.pt"))
    resumed.register_comm_hook(again, sc.ddp_comm_hook)
    for number in range(2, 4):
        for a, b in zip(gradients(going, rank, number), gradients(resumed, rank, number), strict=True):
            assert torch.equal(a, b)
    elsewhere = sc.HierarchicalReducer("dgc", sc.Topology(1), model=DDP(model()))
    with pytest.raises(sc.SparseCommError, match="same topology"):
        elsewhere.load_state_dict(reducer.state_dict())
    for each in (reducer, again, elsewhere):
        each.close()


def node_plans(rank: int, world: int, tmp: str) -> dict:
    """``adaptive`` between nodes, its two shards' links probed unlike (a fast one for local rank 0,
    a slow one for local rank 1), then a run with a byte budget checkpointed and resumed."""
    import sparsecomm.adaptive.controller as controller

    probe = controller.link_throughput
    controller.link_throughput = lambda *args: [1e10, 1e10] if rank % 2 == 0 else [2e5, 2e5]
    try:
        planned = DDP(model())
        reducer = sc.register_ddp_hook(planned, "adaptive", topology=sc.Topology(2))
    finally:
        controller.link_throughput = probe
    modes = []
    for number in range(8):
        gradients(planned, rank, number)
        modes.append(reducer.adaptive.planner.current.mode.value)
    probed = reducer.adaptive.planner.costs.throughput[0]
    reducer.close()

    # the node's reports are on their way at a step's end: a checkpoint holds them
    spec = "adaptive(budget=4000)+residual+rice+fp32+allgather"
    going = DDP(model())
    first = sc.register_ddp_hook(going, spec, topology=sc.Topology(2))
    for number in range(3):
        gradients(going, rank, number)
    torch.save(first.state_dict(), f"{tmp}/planned-{rank}.pt")
    resumed = DDP(model())
    resumed.load_state_dict(going.state_dict())
    again = sc.HierarchicalReducer(spec, sc.Topology(2), model=resumed)
    again.load_state_dict(torch.load(f"{tmp}/planned-{rank}.pt"))
    resumed.register_comm_hook(again, sc.ddp_comm_hook)
    equal = all(torch.equal(a, b) for number in range(3, 7)
                for a, b in zip(gradients(going, rank, number), gradients(resumed, rank, number), strict=True))
    for each in (first, again):
        each.close()
    return {"modes": modes, "probed": probed, "resumed_equal": equal}


def test_a_nodes_ranks_plan_as_one_since_their_shards_share_one_link(tmp_path):
    # the slowest shard's probe is the node's, and every step's reports are agreed over the node:
    # every rank of every node runs the same mode at every step
    results = run_local(4, node_plans, str(tmp_path))
    assert all(r["probed"] == 2e5 for r in results)
    assert all(r["modes"] == results[0]["modes"] for r in results), [r["modes"] for r in results]
    assert all(r["resumed_equal"] for r in results)


def scatters_in_flight(rank: int, world: int) -> dict:
    """A DDP model of several buckets whose node reduce-scatters never report done before waited for."""
    import sparsecomm.reducer.hierarchical as hierarchical

    class Unfinished:  # a reduce-scatter still in flight whenever asked
        def __init__(self, work: dist.Work) -> None:
            self.work = work

        def is_completed(self) -> bool:
            return False

        def wait(self) -> bool:
            events.append("landed")
            return self.work.wait()

    events: list[str] = []
    scatter = hierarchical.reduce_scatter_single

    def started(*args, **kwargs):
        events.append("scatter")
        return Unfinished(scatter(*args, **kwargs))

    hierarchical.reduce_scatter_single = started
    try:
        torch.manual_seed(0)
        layers = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3)))
        plain, ddp = DDP(layers, bucket_cap_mb=0.26), DDP(copy.deepcopy(layers), bucket_cap_mb=0.26)
        reducer = sc.register_ddp_hook(ddp, "dense", topology=sc.Topology(2))
        post = reducer.across.reduce_flat_async

        def posted(*args, **kwargs):
            events.append("post")
            return post(*args, **kwargs)

        reducer.across.reduce_flat_async = posted
        for number in range(2):
            events.clear()
            data = torch.randn(4, 256, generator=torch.Generator().manual_seed(10 * number + rank))
            for net in (plain, ddp):
                net.zero_grad()
                net(data).square().mean().backward()
            for mine, ddps in zip(ddp.parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(mine.grad, ddps.grad, rtol=1e-5, atol=1e-7)
    finally:
        hierarchical.reduce_scatter_single = scatter
    reducer.close()
    return {"events": events}


def test_the_backward_pass_does_not_wait_for_the_nodes_reduce_scatters():
    # no reduce-scatter lands before the last bucket's: every bucket's starts, then the last one's
    # wait posts them all to the hop between nodes, oldest first — and the average is DDP's
    for result in run_local(4, scatters_in_flight):
        buckets = result["events"].count("scatter")
        assert buckets >= 2
        assert result["events"] == ["scatter"] * buckets + ["landed", "post"] * buckets


def test_one_rank_nodes_are_flat_and_a_resume_continues_bit_for_bit(tmp_path):
    run_local(4, resume_and_flat, str(tmp_path))


class WithEmbedding(torch.nn.Module):
    """A sparse embedding's rows next to dense layers, as lm's model has."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(dim=1))


def embedding_gradients(ddp: DDP, rank: int, number: int) -> list[torch.Tensor]:
    # rank 3 uses rows no other rank of its node does; all share rows 0-9
    tokens = torch.randint(0, 10 + 10 * rank, (6, 5), generator=torch.Generator().manual_seed(100 * number + rank))
    ddp.zero_grad()
    ddp(tokens).square().mean().backward()
    return [p.grad.to_dense() if p.grad.is_sparse else p.grad.clone() for p in ddp.parameters()]


def sparse_rows(rank: int, world: int) -> None:
    topology = sc.Topology(2)
    # lossless: DDP's own average of the embedding's rows and the dense layer
    plain, hierarchical = DDP(WithEmbedding()), DDP(WithEmbedding())
    reducer = sc.register_ddp_hook(hierarchical, "dense", topology=topology)
    for number in range(2):
        for mine, ddps in zip(embedding_gradients(hierarchical, rank, number),
                              embedding_gradients(plain, rank, number), strict=True):
            torch.testing.assert_close(mine, ddps, rtol=1e-5, atol=1e-7)
    assert reducer.node_bytes > 0
    reducer.close()

    # lossy, rows selected across nodes: every rank ends with the same rows; a resume continues bit for bit
    lossy, spec = DDP(WithEmbedding()), "topk(ratio=0.3)+residual+rice+fp32"
    reducer = sc.register_ddp_hook(lossy, spec, topology=topology)
    for number in range(3):
        grads = embedding_gradients(lossy, rank, number)
        first, *others = gathered(grads)
        assert all(torch.equal(first, other) for other in others)
    resumed = DDP(WithEmbedding())
    again = sc.HierarchicalReducer(spec, topology, model=resumed)
    again.load_state_dict(reducer.state_dict())
    resumed.register_comm_hook(again, sc.ddp_comm_hook)
    for number in range(3, 5):
        for a, b in zip(embedding_gradients(lossy, rank, number), embedding_gradients(resumed, rank, number),
                        strict=True):
            assert torch.equal(a, b)
    reducer.close()
    again.close()

    # a custom loop with a sparse gradient among dense ones; an empty one too
    with sc.HierarchicalReducer("dense", topology) as custom:
        rows = torch.sparse_coo_tensor(torch.tensor([[rank, 7]]), torch.ones(2, 4) * (rank + 1), (9, 4),
                                       check_invariants=True)
        empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, 4), (9, 4),
                                        check_invariants=True)
        dense = torch.full((5,), float(rank))
        custom.allreduce_([("rows", rows), ("dense", dense), ("empty", empty)])
        expected = torch.zeros(9, 4)
        for r in range(world):
            expected[r] += (r + 1) / world
            expected[7] += (r + 1) / world
        torch.testing.assert_close(rows.to_dense(), expected)
        torch.testing.assert_close(dense, torch.full((5,), (world - 1) / 2))
        assert empty.to_dense().abs().sum() == 0


def test_a_sparse_embeddings_rows_are_summed_in_the_node_and_split_by_row_across_nodes():
    run_local(4, sparse_rows)


def test_rows_that_arrive_cut_short_or_out_of_bounds_are_refused():
    from sparsecomm.reducer.node_rows import _as_bytes, _from_bytes

    like = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.ones(2, 3), (6, 3), check_invariants=True).coalesce()
    data = _as_bytes(like)
    indices, values = _from_bytes(data, like)
    assert torch.equal(indices, like.indices()) and torch.equal(values, like.values())
    with pytest.raises(sc.SparseCommError, match="whole number"):
        _from_bytes(data[:-1], like)
    bad = _as_bytes(torch.sparse_coo_tensor(torch.tensor([[1, 9]]), torch.ones(2, 3), (10, 3),
                                           check_invariants=True).coalesce())
    with pytest.raises(sc.SparseCommError, match="outside"):
        _from_bytes(bad, like)


def disagreeing_topologies(rank: int, world: int) -> str:
    with pytest.raises(sc.SparseCommError, match="topology") as raised:
        sc.HierarchicalReducer("dense", sc.Topology(1 + rank))
    return str(raised.value)


def test_ranks_with_different_topologies_all_raise():
    assert len(run_local(2, disagreeing_topologies)) == 2


@pytest.mark.parametrize("local_size", [1, 2, 3, 8])
def test_node_shards_own_every_element_once_and_put_it_back(local_size):
    segments = (Segment("one", 0, 1), Segment("seven", 3, 7, whole=True), Segment("big", 10, 1000))
    shards = NodeShards.of(segments, 1012, local_size, torch.device("cpu"))
    buffer = torch.randn(1012)
    laid_out = shards.to_shards(buffer).view(local_size, shards.shard_numel)
    owned = [laid_out[local, :shards.owned_numel(local)] for local in range(local_size)]
    covered = torch.cat([shards.index.view(local_size, -1)[local, :o.numel()] for local, o in enumerate(owned)])
    assert sorted(covered.tolist()) == [*range(1), *range(3, 10), *range(10, 1010)]  # each element once
    assert all(seg.whole == (seg.key == "seven") for own in shards.owned for seg in own)
    back = shards.from_shards(laid_out.reshape(-1))
    assert torch.equal(back[:1], buffer[:1]) and torch.equal(back[3:1010], buffer[3:1010])


def test_topology_comes_from_torchruns_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "2")
    topology = sc.Topology.from_env()
    assert topology == sc.Topology(4) and topology.describe(8) == "2 nodes × 4 ranks"
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(sc.SparseCommError, match="local rank 2 of node 1"):
        sc.Topology.from_env()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(sc.SparseCommError, match="torchrun"):
        sc.Topology.from_env()
    with pytest.raises(sc.SparseCommError, match="do not fill"):
        sc.Topology(3).nodes(8)
    with pytest.raises(sc.SparseCommError, match="at least one"):
        sc.Topology(0)


def node_mismatches(rank: int, world: int) -> list[str]:
    """A node's two ranks differing in a gradient's dtype, then in a setting: refused on every rank
    (the hop between nodes checks its own ranks only, never a node's two)."""
    outcomes = []
    with sc.HierarchicalReducer("dense", sc.Topology(2)) as reducer:
        gradient = torch.ones(1000, dtype=torch.float64 if rank == 1 else torch.float32)
        outcomes.append(outcome(reducer.allreduce_, [("g", gradient)]))
    outcomes.append(outcome(lambda: sc.HierarchicalReducer("dense", sc.Topology(2), average=rank != 1).close()))
    return outcomes


def test_a_nodes_ranks_that_differ_in_a_dtype_or_a_setting_are_refused_on_every_rank():
    for dtypes, settings in run_local(4, node_mismatches):
        assert "ranks disagree" in dtypes and "'gradients g'" in dtypes, dtypes
        assert "ranks disagree" in settings and "HierarchicalReducer topology and settings" in settings, settings


def screened(rank: int, world: int, policy: str) -> list[list[float]]:
    """Rank r's gradient is r + 1 everywhere, and rank 3's first entry NaN: flat and hierarchical."""
    results = []
    for make in (lambda: sc.GradientReducer("dense", nonfinite=policy),
                 lambda: sc.HierarchicalReducer("dense", sc.Topology(2), nonfinite=policy)):
        with make() as reducer:
            gradient = torch.full((8,), float(rank + 1))
            rows = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.full((2, 2), float(rank + 1)), (5, 2))
            if rank == 3:
                gradient[0] = float("nan")
                rows = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.tensor([[float("nan"), 4.0], [4.0, 4.0]]),
                                               (5, 2))
            reducer.allreduce_([("g", gradient), ("rows", rows)])
            results.append(gradient.tolist() + rows.to_dense()[[1, 3]].reshape(-1).tolist())
    return results


@pytest.mark.parametrize("policy", ["skip", "zero"])
def test_skip_and_zero_treat_a_ranks_own_gradient_as_a_flat_group_does(policy):
    for flat, hierarchical in run_local(4, screened, policy):
        assert flat == hierarchical, (flat, hierarchical)
        # skip: rank 3 sends nothing of the call (the gradient or the rows); zero: all but its NaN entry
        assert flat == ([1.5] * 12 if policy == "skip" else [1.5] + [2.5] * 7 + [1.5] + [2.5] * 3), flat


def over_a_part_of_the_world(rank: int, world: int) -> float:
    """Two data-parallel groups, [0, 2] and [1, 3], each a HierarchicalReducer of one-rank nodes:
    each makes its own groups, without the other's ranks."""
    groups = dist.new_group([0, 2]), dist.new_group([1, 3])
    with sc.HierarchicalReducer("dense", sc.Topology(1), group=groups[rank % 2]) as reducer:
        gradient = torch.full((10,), float(rank))
        reducer.allreduce_([("g", gradient)])
    return float(gradient[0])


def test_a_hierarchical_reducer_over_a_process_subgroup_makes_its_groups_alone():
    assert run_local(4, over_a_part_of_the_world) == [1.0, 2.0, 1.0, 2.0]


def meshes_apart(rank: int, world: int) -> str:
    return outcome(sc.Topology(2 if rank == 0 else 4).device_mesh, "cpu")


def test_ranks_asking_for_meshes_of_different_topologies_are_refused():
    for said in run_local(4, meshes_apart):
        assert "ranks disagree" in said and "Topology.device_mesh" in said, said


def checkpoints_of_another_kind(rank: int, world: int) -> list[str]:
    with sc.HierarchicalReducer("dense", sc.Topology(2)) as hierarchical, sc.GradientReducer("dense") as flat:
        hierarchical.allreduce_([("g", torch.ones(10))])
        flat.allreduce_([("g", torch.ones(10))])
        return [outcome(loading.load_state_dict, state)
                for loading, state in ((flat, hierarchical.state_dict()), (hierarchical, flat.state_dict()))]


def test_a_checkpoint_of_another_kind_of_reducer_is_refused_naming_its_writer():
    for into_flat, into_hierarchical in run_local(4, checkpoints_of_another_kind):
        assert "HierarchicalReducer.state_dict()" in into_flat, into_flat
        assert "GradientReducer.state_dict()" in into_hierarchical, into_hierarchical
