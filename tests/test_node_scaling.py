"""The projection over nodes: two α-β links (the fabric inside a node, the network between nodes),
flat rows next to hierarchical ones, anchored at a run's own layout."""

import pytest

from sparsecomm.train.node_scaling import Layout, crossing_bytes, project, step_s, table
from sparsecomm.train.scaling import RowCosts

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
        assert crossing_bytes(split, layout, True) == pytest.approx(2 * (nodes - 1) * MB)
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
    return {"workload": "toy", "workers": workers, "nodes": nodes, "link": "100mbit", "rows": rows, "curves": curves}


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
