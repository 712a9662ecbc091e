"""Projected scaling over nodes: every row of a `sparsecomm train` run on N nodes of G ranks each,
flat and, for sparsecomm's sparse presets (the payload allgather, SparCML's sparse allreduce,
``adaptive``), hierarchically too (rows ``hier:PRESET``), by the α-β model of
`sparsecomm.train.node_model` — a sparse embedding's rows sent by row where the run recorded them
(`sparsecomm.train.sparse_rows`).

Each row is anchored at the measured run as `sparsecomm.train.scaling` anchors it: what its flat
row's median step took beyond the model at the run's own layout (its nodes and ranks per node, its
shaped link; inside a node loopback, modeled as free) stays in every projected step, flat or
hierarchical — a run's in-node collectives on loopback, among ranks sharing a few cores, time the
scheduler, not a fabric. The model's bytes between nodes are checked against what crossed the run's
link (`check_bytes`). FSDP2's rows are not projected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from sparsecomm.train.node_model import SPLIT, Layout, crossing_bytes, step_s
from sparsecomm.train.row_names import HIERARCHICAL
from sparsecomm.train.scaling import (
    LINKS,
    Panel,
    RowCosts,
    dense_bytes,
    flat_rows,
    median_step_s,
    plot_panels,
    run_link,
)
from sparsecomm.train.sparse_rows import FIELD

FABRICS = MappingProxyType({"nvlink": (2.4e12, 5e-6), "pcie": (192e9, 10e-6)})
"""inside a node, per rank: rate (bits/s) and per-message latency α (s) — NVLink-class (300 GB/s a
direction) and PCIe 4.0 ×16 as NCCL reaches it (24 GB/s)"""
NODES = (1, 2, 4, 8, 16, 32)
PER_NODE = 8
"""ranks per node: a node of 8 GPUs"""


def project(result: dict[str, Any], per_node: int = PER_NODE, nodes: tuple[int, ...] = NODES,
            fabrics: Mapping[str, tuple[float, float]] = FABRICS,
            networks: Mapping[str, tuple[float, float]] = LINKS) -> dict[str, Any]:
    """Per row (flat, and ``hier:`` for the sparse presets), fabric, network and node count:
    projected ms per step and speed-up over one rank, anchored at ``result``'s measured run."""
    anchors = _anchors(result, dense_bytes(result))
    points = []
    for (name, hierarchical), (cost, unmodeled_s) in anchors.items():
        for fabric, fabric_link in fabrics.items():
            for network, network_link in networks.items():
                for count in nodes:
                    layout = Layout(count, per_node, fabric_link, network_link)
                    seconds = step_s(cost, layout, hierarchical) + (unmodeled_s if layout.ranks > 1 else 0.0)
                    points.append({"preset": HIERARCHICAL + name if hierarchical else name, "fabric": fabric,
                                   "network": network, "nodes": count, "per_node": per_node,
                                   "workers": layout.ranks, "ms": 1e3 * seconds,
                                   "speedup": layout.ranks * cost.compute_s / seconds})
    return {"benchmark": "node-scaling", "workload": result["workload"], "anchor": result.get("link"),
            "anchor_layout": [result.get("nodes", 1), result["workers"] // result.get("nodes", 1)],
            "fabrics": {k: list(v) for k, v in fabrics.items()}, "networks": {k: list(v) for k, v in networks.items()},
            "per_node": per_node, "node_counts": list(nodes), "points": points, "sparse_rows": FIELD in result,
            "check": check_bytes(result) if result.get("nodes", 1) > 1 else []}


def _anchors(result: dict[str, Any], dense: float) -> dict[tuple[str, bool], tuple[RowCosts, float]]:
    """(preset, hierarchical) → its flat row's costs (the hierarchical projection starts from the
    whole model's bytes, less the sparse gradients' where the run recorded them) and what its
    measured step took beyond the model at the run's layout."""
    flat = {row["preset"]: RowCosts.from_row(row, dense, result.get(FIELD)) for row in flat_rows(result)}
    point = run_link(result)
    measured_nodes = result.get("nodes", 1)
    if point is None:  # loopback: no link to anchor at, the bare model
        layout = None
    elif measured_nodes > 1:
        layout = Layout(measured_nodes, result["workers"] // measured_nodes, (math.inf, 0.0), point)
    else:  # each worker its own node on the shaped link
        layout = Layout(result["workers"], 1, (math.inf, 0.0), point)

    anchors = {}
    for name, cost in flat.items():
        extra = 0.0
        if layout is not None and name in result.get("curves", {}):
            extra = max(0.0, median_step_s(result, name) - step_s(cost, layout, False))
        anchors[(name, False)] = (cost, extra)
        if cost.kind in SPLIT:
            anchors[(name, True)] = (cost, extra)
    return anchors


def check_bytes(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each row's bytes between nodes as the model sends them at the run's layout, beside what
    crossed its link (``link_bytes_per_step``, headers included)."""
    nodes, dense = result.get("nodes", 1), dense_bytes(result)
    layout = Layout(nodes, result["workers"] // nodes, (math.inf, 0.0), (math.inf, 0.0))
    crossed = {row["preset"]: row.get("link_bytes_per_step") for row in result["rows"]}
    checked = []
    for row in flat_rows(result):
        cost = RowCosts.from_row(row, dense, result.get(FIELD))
        for name, hierarchical in ((row["preset"], False), (HIERARCHICAL + row["preset"], True)):
            measured = crossed.get(name)
            modeled = crossing_bytes(cost, layout, hierarchical)
            if measured and modeled:
                checked.append({"preset": name, "measured_bytes": measured, "modeled_bytes": modeled,
                                "error_pct": 100 * (modeled - measured) / measured})
    return checked


def table(projection: dict[str, Any], fabric: str, nodes: tuple[int, ...] = (2, 8, 32)) -> list[dict[str, Any]]:
    """One row per preset: speed-up over one rank at ``nodes`` nodes on each network, inside
    nodes joined by ``fabric``."""
    rows: dict[str, dict[str, Any]] = {}
    for point in projection["points"]:
        if point["fabric"] == fabric and point["nodes"] in nodes:
            rows.setdefault(point["preset"], {"preset": point["preset"]})[
                f"{point['network']} {point['nodes']}×{point['per_node']}"] = point["speedup"]
    return list(rows.values())


def plot(projection: dict[str, Any], path: str, fabric: str = "nvlink") -> None:
    """Speed-up over one rank against the number of nodes, one panel per network, one line per row,
    inside nodes joined by ``fabric``."""
    counts = projection["node_counts"]
    panels = []
    for network in projection["networks"]:
        by_row: dict[str, list[tuple[int, float]]] = {}
        for point in projection["points"]:
            if point["network"] == network and point["fabric"] == fabric:
                by_row.setdefault(point["preset"], []).append((point["nodes"], point["speedup"]))
        panels.append(Panel(f"{projection['workload']}, {fabric} inside, {network} between", by_row, counts,
                            [n * projection["per_node"] for n in counts]))
    plot_panels(panels, f"nodes of {projection['per_node']} ranks", "speed-up over one rank (projected)", path)
