"""The projection over nodes: two α-β links (the fabric inside a node, the network between nodes),
flat rows next to hierarchical ones, anchored at a run's own layout."""

from dataclasses import replace

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.launch import run_local
from sparsecomm.train.node_model import inside_bytes
from sparsecomm.train.node_scaling import Layout, crossing_bytes, project, step_s, table
from sparsecomm.train.scaling import RowCosts
from sparsecomm.train.sparse_rows import FIELD, record
from sparsecomm.transport.owner_counts import owner_counts_bytes

MB = 1e6
NVLINK, GBIT = (2.4e12, 0.0), (1e9, 0.0)


def row(name: str, kind: str, nbytes: float, **extra) -> RowCosts:
    return RowCosts(name, kind, compute_s=0.010, encode_s=0.0, decode_s=0.0, bytes_per_step=nbytes,
                    dense_bytes=100 * MB, measured_workers=2, **extra)


def test_a_dense_allreduce_moves_the_node_shares_through_each_link():
    dense = row("dense", "allreduce", 100 * MB)
    layout = Layout(4, 8, NVLINK, GBIT)
    inside, across = 2 * 7 / 8 * 100 * MB * 8 / 2.4e12, 2 * 3 / 4 * 100 * MB * 8e-9
    assert step_s(dense, layout, False) == pytest.approx(0.010 + inside + across)
    assert step_s(dense, Layout(1, 1, NVLINK, GBIT), False) == 0.010


def test_a_flat_allgather_carries_every_ranks_payload_through_its_node_and_a_hierarchical_one_a_shard():
    gathered = RowCosts("dgc", "allgather", 0.010, 0.004, 0.002, 1 * MB, 100 * MB, measured_workers=2)
    layout = Layout(4, 8, NVLINK, GBIT)
    flat = step_s(gathered, layout, False)
    # 31 payloads decoded; 7 over the fabric, 24 through the node's link for each of its 8 ranks
    assert flat == pytest.approx(0.010 + 0.004 + 0.002 * 31 + 7 * MB * 8 / 2.4e12 + 8 * 24 * MB * 8e-9)
    hierarchical = step_s(gathered, layout, True)
    # the dense reduce-scatter and all-gather inside, then 3 other nodes' shards of 1/8
    assert hierarchical == pytest.approx(0.010 + 2 * 7 / 8 * 100 * MB * 8 / 2.4e12 + 0.004 / 8 + 0.002 * 3 / 8
                                         + 3 * MB * 8e-9)
    assert hierarchical < flat / 10


def test_adaptive_and_sparcml_take_the_hierarchical_path_where_it_is_cheaper():
    adaptive = row("adaptive", "adaptive", 50 * MB, sparse_overhead_s=0.004, bytes_per_nnz=1.5, sparse_density=0.001)
    sparcml = row("sparcml", "sparse_allreduce", 1 * MB)
    for cost in (adaptive, sparcml):
        layout = Layout(32, 8, NVLINK, GBIT)
        assert step_s(cost, layout, True) < step_s(cost, layout, False)


def test_the_global_top_k_sends_a_bounded_share_of_a_selection_per_rank_whatever_the_ranks():
    """SparCML's split-allgather keeping a global top-k (``topk_sa``): a rank's bytes through the
    node's link stay under two selections from 8 to 256 ranks, where the payload allgather's grow
    with the ranks; with 1 MB a step measured on 2 ranks, a selection is 1 MB."""
    split = row("global", "split_topk", 1 * MB)
    gathered = row("dgc", "allgather", 1 * MB)
    per_rank = []
    for nodes in (1, 2, 4, 8, 16, 32):
        layout = Layout(nodes, 8, NVLINK, GBIT)
        crossing = crossing_bytes(split, layout, False)
        assert crossing is not None
        per_rank.append(crossing / layout.ranks)
        # two selections (what a rank measured less its owner's counts to the other rank) per other
        # node, and each owner's counts of its range to the owners on the other nodes
        selection = 1 * MB - owner_counts_bytes(2)
        assert crossing_bytes(split, layout, True) == pytest.approx(
            2 * (nodes - 1) * selection + layout.ranks * owner_counts_bytes(nodes))
        if nodes > 1:
            assert step_s(split, layout, False) < step_s(gathered, layout, False)
    assert per_rank[0] == 0 and all(1 * MB <= b < 2 * MB for b in per_rank[1:])
    assert gathered_per_rank(gathered, 32) == pytest.approx(31 * gathered_per_rank(gathered, 2))  # P − G payloads


def gathered_per_rank(cost: RowCosts, nodes: int) -> float:
    layout = Layout(nodes, 8, NVLINK, GBIT)
    crossing = crossing_bytes(cost, layout, False)
    assert crossing is not None
    return crossing / layout.ranks


def result(steps_s: dict[str, float], nodes: int = 2, workers: int = 4) -> dict:
    """A train result of ``nodes`` nodes on 100 Mbit/s whose rows took ``steps_s`` per step."""
    rows = [{"preset": name, "steps": 10, "compute_s": 0.1, "encode_s": 0.01, "decode_s": 0.01, "workers": workers,
             "bytes_per_step": 4e5 if name.endswith("dense") else 4e3} for name in steps_s]
    curves = {name: {"elapsed_s": [step * (i + 1) for i in range(10)]} for name, step in steps_s.items()}
    return {"benchmark": "train", "workload": "toy", "workers": workers, "nodes": nodes, "link": "100mbit",
            "rows": rows, "curves": curves}


def test_rows_are_anchored_at_the_runs_layout_and_fsdp_rows_are_left_out():
    measured = result({"dense": 0.2, "dgc": 0.05, "hier:dgc": 0.03, "fsdp:dgc": 0.04})
    projection = project(measured, per_node=2, nodes=(2,), fabrics={"loopback": (float("inf"), 0.0)},
                         networks={"100mbit": (100e6, 50e-6)})
    at_anchor = {point["preset"]: point["ms"] for point in projection["points"]}
    assert set(at_anchor) == {"dense", "dgc", "hier:dgc"}  # the projection of FSDP2's rows is not modeled
    # the run's own layout and link: each flat row its measured median step (where the model is below
    # it); the hierarchical row keeps its flat row's unexplained part (its loopback in-node steps are
    # the scheduler's), its bytes between nodes a shard's
    assert at_anchor["dense"] == pytest.approx(200.0) and at_anchor["dgc"] == pytest.approx(50.0)
    assert at_anchor["hier:dgc"] < at_anchor["dgc"]
    assert projection["anchor_layout"] == [2, 2]


def test_the_models_bytes_between_nodes_are_checked_against_the_links_counters():
    measured = result({"dense": 0.2, "dgc": 0.05, "hier:dgc": 0.03})
    crossed = {"dense": 1.7e6, "dgc": 33e3, "hier:dgc": 8.5e3}  # per step, both nodes' links
    for row in measured["rows"]:
        row["link_bytes_per_step"] = crossed[row["preset"]]
    checked = {row["preset"]: row for row in project(measured)["check"]}
    # 2 nodes × 2 ranks: dense 2·(N−1)·B; flat dgc each node's 2 ranks take the other node's 2
    # payloads (N·G·(P−G)·B); hierarchical dgc one shard payload each way per local rank (N·(N−1)·B)
    assert {name: row["modeled_bytes"] for name, row in checked.items()} == {
        "dense": 2 * 4e5, "dgc": 2 * 2 * 2 * 4e3, "hier:dgc": 2 * 4e3}
    assert checked["dgc"]["error_pct"] == pytest.approx(100 * (32e3 - 33e3) / 33e3)


def test_the_node_table_gives_each_row_its_speedup_per_network_and_node_count():
    projection = project(result({"dense": 0.2, "dgc": 0.05}, nodes=1, workers=2))
    rows = {r["preset"]: r for r in table(projection, "nvlink")}
    assert set(rows) == {"dense", "dgc", "hier:dgc"}
    assert set(rows["dgc"]) == {"preset"} | {f"{net} {n}×8" for net in ("1gbit", "10gbit", "100gbit")
                                                for n in (2, 8, 32)}
    assert rows["hier:dgc"]["1gbit 32×8"] > rows["dgc"]["1gbit 32×8"]


def test_the_scaling_command_projects_a_run_on_several_nodes_over_nodes(tmp_path, capsys):
    import json

    from sparsecomm.cli.main import main

    source, out = tmp_path / "nodes.json", tmp_path / "projection.json"
    source.write_text(json.dumps(result({"dense": 0.2, "dgc": 0.05, "hier:dgc": 0.03})))
    assert main(["scaling", "--from", str(source), "--json", str(out), "--plot", str(tmp_path / "s.png")]) == 0
    printed = capsys.readouterr().out
    assert "a run on 2 nodes: projected over nodes of ranks" in printed
    assert "nodes of 8 ranks joined inside by nvlink" in printed and "joined inside by pcie" in printed
    assert "anchored at this run's 2 node(s) × 2 rank(s) on 100mbit" in printed
    assert {point["preset"] for point in json.loads(out.read_text())["points"]} == {"dense", "dgc", "hier:dgc"}
    assert (tmp_path / "s.png").stat().st_size > 0  # speed-up against nodes


TOPK = "topk(ratio=0.01)+residual+rice+fp32+allgather"
ROWS = {"parameters": ["embedding.weight"], "dense_bytes": 40 * MB, "other_bytes": 60 * MB, "row_bytes": 264.0,
        "total_rows": 10_000, "rows": {"1": 100, "2": 180, "4": 300, "8": 480}}
"""a run's sparse gradients: 40 MB of a 100 MB model as 264-byte rows, 100 touched a step by one rank"""


def embedding_row(preset: str, sparse_bytes: float | None) -> dict:
    """A flat row of 1 MB a rank and step, ``sparse_bytes`` of it the embedding's (None: not recorded)."""
    row = {"preset": preset, "steps": 10, "compute_s": 0.1, "encode_s": 0.0, "decode_s": 0.0, "workers": 2,
           "bytes_per_step": 1 * MB}
    return row if sparse_bytes is None else row | {"sparse_bytes_per_step": sparse_bytes}


def test_a_hierarchical_row_sends_a_sparse_gradients_rows_by_row_inside_and_between_nodes():
    layout = Layout(2, 4, NVLINK, GBIT)  # 2 nodes of 4: 8 ranks
    rows = RowCosts.from_row(embedding_row(TOPK, 100 * 264), 100 * MB, ROWS)  # its rows: 264 bytes each
    dense = RowCosts.from_row(embedding_row(TOPK, 100 * 264), 100 * MB)
    assert rows.sparse is not None and rows.sparse.travel == "allgather" and dense.sparse is None
    # inside: the rest's reduce-scatter and all-gather, each rank's 100 rows and its 480/4 averaged
    # rows to 3 peers — below the reduce-scatter and all-gather of the whole 100 MB
    assert inside_bytes(rows, layout, True) == pytest.approx(2 * 3 / 4 * 60 * MB + 3 * (100 + 480 / 4) * 264)
    assert inside_bytes(rows, layout, True) < inside_bytes(dense, layout, True) == pytest.approx(2 * 3 / 4 * 100 * MB)
    assert inside_bytes(rows, layout, False) is None
    # between nodes: the rest's payload, and the node's 300 rows (4 ranks' union) once, each way
    rest = 1 * MB - 100 * 264
    assert crossing_bytes(rows, layout, True) == pytest.approx(2 * (rest + 300 * 264))
    assert step_s(rows, layout, True) == pytest.approx(
        0.010 + 2 * 3 / 4 * 60 * MB * 8 / 2.4e12 + rest * 8e-9  # the rest as a dense model's shards
        + 3 * (100 + 480 / 4) * 264 * 8 / 2.4e12 + 300 * 264 * 8e-9)  # the rows' two all-gathers, the node's rows
    # adaptive: the cheapest of its modes for the rest, the rows as the run sent them in every mode
    adaptive = RowCosts.from_row(embedding_row("adaptive", 100 * 264) | {"sparse_overhead_s": 0.004}, 100 * MB, ROWS)
    others = replace(adaptive, bytes_per_step=rest, dense_bytes=60 * MB, sparse=None)
    assert step_s(adaptive, layout, True) == pytest.approx(
        step_s(others, layout, True) + 3 * (100 + 480 / 4) * 264 * 8 / 2.4e12 + 300 * 264 * 8e-9)
    # flat rows are left as they are: the rows are in the payload the run measured
    assert step_s(rows, layout, False) == step_s(dense, layout, False)
    assert crossing_bytes(rows, layout, False) == crossing_bytes(dense, layout, False)


def test_rows_selected_from_as_a_dense_tensor_send_each_ranks_flat_selection_between_nodes():
    layout = Layout(2, 4, NVLINK, GBIT)
    dgc = RowCosts.from_row(embedding_row("dgc", 5_000), 100 * MB, ROWS)
    assert dgc.sparse is not None and dgc.sparse.travel == "selected"
    assert crossing_bytes(dgc, layout, True) == pytest.approx(2 * (1 * MB - 5_000 + 4 * 5_000))
    # through an exact sparse allreduce, round t carries the rows of 2^t nodes' union: 2 rounds over 4 nodes of 2
    exact = "topk(ratio=0.01)+residual+raw+fp32+sparse_allreduce(algorithm=ssar_rd)"
    doubling = RowCosts.from_row(embedding_row(exact, 100 * 264), 100 * MB, ROWS)
    assert doubling.sparse is not None and doubling.sparse.travel == "doubling"
    layout = Layout(4, 2, NVLINK, GBIT)
    rest = replace(doubling, bytes_per_step=1 * MB - 100 * 264, dense_bytes=60 * MB, sparse=None)
    assert step_s(doubling, layout, True) == pytest.approx(
        step_s(rest, layout, True) + 1 * (100 + 480 / 2) * 264 * 8 / 2.4e12 + (180 + 300) * 264 * 8e-9)
    assert crossing_bytes(doubling, layout, True) is None
    # PyTorch's rows count the embedding dense, and are projected as they are
    assert RowCosts.from_row(embedding_row("torch-allreduce", None), 100 * MB, ROWS).sparse is None


def test_the_rows_ranks_touch_together_are_read_between_and_beyond_the_sampled_counts():
    rows = RowCosts.from_row(embedding_row(TOPK, None), 100 * MB, ROWS).sparse
    assert rows is not None
    assert rows.sent_bytes == 100 * 264  # not recorded: its touched rows, raw
    assert rows.rows(4) == 300 and rows.rows(3) == pytest.approx(180 + (300 - 180) * 0.5849625, rel=1e-6)
    assert rows.rows(16) == 960 and rows.rows(256) == 10_000  # in proportion, never past the table


def test_a_run_without_sparse_rows_projects_its_rows_as_dense_and_one_with_them_only_its_hierarchical_rows():
    measured = result({"dense": 0.2, TOPK: 0.05})
    for row in measured["rows"]:
        row["sparse_bytes_per_step"] = 800 if row["preset"] == TOPK else None
    plain = project(measured, nodes=(2, 8))
    assert plain["sparse_rows"] is False
    rows = {"parameters": ["embedding.weight"], "dense_bytes": 1e5, "other_bytes": 3e5, "row_bytes": 264.0,
            "total_rows": 400, "rows": {"1": 3, "2": 5, "4": 8, "8": 12}}
    with_rows = project(measured | {FIELD: rows}, nodes=(2, 8))
    assert with_rows["sparse_rows"] is True
    pairs = list(zip(plain["points"], with_rows["points"], strict=True))
    flat = [(a, b) for a, b in pairs if not a["preset"].startswith("hier:")]
    assert flat and all(a == b for a, b in flat)
    hierarchical = [(a, b) for a, b in pairs if a["preset"].startswith("hier:")]
    assert hierarchical and all(a["ms"] != b["ms"] for a, b in hierarchical)


class RowsWorkload:
    """A toy workload: rank r's batch reads rows r mod 10 and 50 of a sparse embedding."""

    @staticmethod
    def model(seed: int):
        return torch.nn.Sequential(torch.nn.Embedding(100, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 2))

    @staticmethod
    def batches(rank: int, world: int, steps: int, batch: int, seed: int):
        for _ in range(steps):
            yield (torch.tensor([[rank % 10, 50]]),)

    @staticmethod
    def loss(model, batch):
        return model(batch[0]).sum()


def test_a_run_records_its_sparse_gradients_and_the_rows_ranks_touch_together():
    recorded = record(RowsWorkload(), 1, 0)
    assert recorded is not None
    assert recorded["parameters"] == ["0.weight"] and recorded["dense_bytes"] == 4 * 400
    assert recorded["other_bytes"] == 4 * (8 * 2 + 2) and recorded["row_bytes"] == 8 + 16
    # ranks 0…k−1 touch rows 0…min(k, 10)−1 and 50; the mean over groups of k ranks
    assert recorded["rows"]["1"] == 2 and recorded["rows"]["2"] == 3 and recorded["rows"]["8"] == 9
    assert recorded["rows"]["16"] == 11 and recorded["rows"]["256"] == 11
    dense = type("Dense", (RowsWorkload,), {"model": staticmethod(lambda seed: torch.nn.Linear(2, 2))})
    assert record(dense(), 1, 0) is None


def embedding_tokens(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.rand(8, 4, generator=generator) ** 3 * 400).long()  # frequent rows shared between ranks


def node_bytes_per_step(rank: int, world: int, steps: int) -> float:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Embedding(400, 16, sparse=True), torch.nn.Flatten(),
                                    torch.nn.Linear(64, 10)))
    reducer = sc.register_ddp_hook(model, TOPK, topology=sc.Topology(2))
    for step in range(steps):
        model.zero_grad()
        model(embedding_tokens(rank, step)).square().mean().backward()
    reducer.close()
    return reducer.node_bytes / steps


def test_the_modeled_bytes_inside_a_node_are_what_the_hierarchical_reducer_sends_there():
    """Two nodes of two ranks: each rank's mean bytes to its node (`HierarchicalReducer.node_bytes`)
    are the model's, from the rows the ranks' batches touch."""
    steps = 3

    def touched(ranks: range) -> float:  # rows a step touches on ``ranks`` together, over the steps
        return sum(len(set().union(*(set(embedding_tokens(r, s).reshape(-1).tolist()) for r in ranks)))
                   for s in range(steps)) / steps

    one = sum(touched(range(r, r + 1)) for r in range(4)) / 4
    field = {"parameters": ["0.weight"], "dense_bytes": 4 * 400 * 16, "other_bytes": 4 * (64 * 10 + 10),
             "row_bytes": 8 + 16 * 4, "total_rows": 400, "rows": {"1": one, "4": touched(range(4))}}
    cost = RowCosts.from_row(embedding_row(TOPK, None), 4 * (400 * 16 + 64 * 10 + 10), field)
    measured = run_local(4, node_bytes_per_step, steps)
    assert sum(measured) / 4 == pytest.approx(inside_bytes(cost, Layout(2, 2, NVLINK, GBIT), True), rel=1e-9)
