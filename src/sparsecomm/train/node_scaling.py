"""Projected scaling over nodes: N nodes of G ranks each (P = N·G), the ranks of a node joined by a
fast fabric (NVLink- or PCIe-class) and the nodes by a slower network — two α-β links. Every row of
a `sparsecomm train` run is projected flat (every rank a peer) and, for sparsecomm's sparse presets
(the payload allgather, SparCML's sparse allreduce, ``adaptive``), also hierarchically
(`HierarchicalReducer`: dense inside each node, the preset between nodes on each rank's 1/G shard;
rows ``hier:PRESET``). An all_reduce row is modeled as NCCL runs it over nodes, hierarchical
already.

A network rate is a node's: its G ranks share its link to the other nodes. Per step, with B a rank's
bytes for the row, D the dense gradient's bytes, and the compute, encoding and decoding the run
measured (`sparsecomm.train.scaling.RowCosts`):

- all_reduce rows (DDP, fp16, PowerSGD, S2's sketch, dense) as NCCL runs them over nodes: a
  reduce-scatter and an all-gather inside the node, 2(G−1)/G·B on the fabric, and each shard
  all-reduced across nodes, 2(N−1)/N·B through the node's link (2⌈log2 G⌉ and 2⌈log2 N⌉ messages);
- payload allgather, flat: each rank takes P−1 payloads, G−1 over the fabric and P−G through its
  node's link, which carries them for its G ranks (G·(P−G)·B), and decodes all P−1;
- payload allgather, hierarchical: the dense reduce-scatter and all-gather inside the node (D), then
  each rank's shard payload to the N−1 other nodes: (N−1)·B through the node's link, and N−1
  payloads of a 1/G shard to decode (encoding a 1/G shard too);
- SparCML's sparse allreduce (recursive doubling): flat, its first log2 G rounds inside the node and
  the rest through the link for all G ranks at once; hierarchical, the rounds across nodes on the
  shards (encoding and summing a 1/G shard);
- SparCML's split-allgather keeping a global top-k (``topk_sa``), with S one rank's selection: an
  all-to-all by range and an allgather of the owners' top entries, 2(P−1)/P·S a rank, the share
  (P−G)/P of it through the node's link for its G ranks; hierarchical, the same across nodes on
  1/G shards (its α per member: (N−1 + ⌈log2 N⌉) messages);
- adaptive: the cheapest of its modes — dense fp32 or fp16 as an all_reduce row, or sparse at its
  run's density (capped as `sparsecomm.train.scaling` caps it) as a payload allgather.

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
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

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

FABRICS = MappingProxyType({"nvlink": (2.4e12, 5e-6), "pcie": (192e9, 10e-6)})
"""inside a node, per rank: rate (bits/s) and per-message latency α (s) — NVLink-class (300 GB/s a
direction) and PCIe 4.0 ×16 as NCCL reaches it (24 GB/s)"""
NODES = (1, 2, 4, 8, 16, 32)
SPLIT = ("allgather", "adaptive", "sparse_allreduce", "split_topk")
"""the kinds of row projected hierarchically too: an all_reduce row is modeled as NCCL runs it over
nodes, hierarchical already"""
PER_NODE = 8
"""ranks per node: a node of 8 GPUs"""


@dataclass(frozen=True)
class Layout:
    """``nodes`` nodes of ``per_node`` ranks, the fabric inside a node and the network between
    nodes as (bits/s, α)."""

    nodes: int
    per_node: int
    fabric: tuple[float, float]
    network: tuple[float, float]

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


def step_s(cost: RowCosts, layout: Layout, hierarchical: bool) -> float:
    """The α-β model of one step of ``cost``'s row on ``layout`` (no anchoring)."""
    if layout.ranks == 1:
        return cost.compute_s
    if cost.kind == "allreduce":
        return (cost.compute_s + cost.encode_s + cost.decode_s
                + cost.collectives * _allreduce(layout, cost.bytes_per_step))
    if cost.kind == "peeled_sketch":
        decode_s, nbytes = cost.peeled_sketch(layout.ranks)
        return cost.compute_s + cost.encode_s + decode_s + _allreduce(layout, nbytes)
    if cost.kind == "adaptive":
        modes = [cost.compute_s + _allreduce(layout, cost.dense_bytes),
                 cost.compute_s + _allreduce(layout, cost.dense_bytes / 2)]
        if cost.sparse_overhead_s is not None:
            modes.append(_sparse_mode(cost, layout, hierarchical))
        return min(modes)
    if cost.kind == "sparse_allreduce":  # hierarchically, each rank encodes and sums a 1/G shard
        codecs = (cost.encode_s + cost.decode_s) / (layout.per_node if hierarchical else 1)
        return cost.compute_s + codecs + _recursive_doubling(cost, layout, hierarchical)
    if cost.kind == "split_topk":
        return cost.compute_s + _split_topk(cost, layout, hierarchical)
    peer_decode_s = cost.decode_s / max(1, cost.measured_workers - 1)
    return cost.compute_s + _allgather(layout, cost.bytes_per_step, cost.dense_bytes, cost.encode_s, peer_decode_s,
                                       hierarchical)


def _beta(link: tuple[float, float]) -> float:
    return 8 / link[0]


def _rounds(members: int) -> int:
    return math.ceil(math.log2(members)) if members > 1 else 0


def _allreduce(layout: Layout, nbytes: float) -> float:
    """A dense all_reduce of ``nbytes`` per rank: inside the node, then each shard across nodes."""
    per_node, nodes = layout.per_node, layout.nodes
    inside = 2 * (per_node - 1) / per_node * nbytes * _beta(layout.fabric) + 2 * _rounds(per_node) * layout.fabric[1]
    across = 2 * (nodes - 1) / nodes * nbytes * _beta(layout.network) + 2 * _rounds(nodes) * layout.network[1]
    return inside + across


def _allgather(layout: Layout, nbytes: float, dense: float, encode_s: float, peer_decode_s: float,
               hierarchical: bool) -> float:
    """Payloads of ``nbytes`` per rank (a whole model's), gathered flat or between nodes on shards."""
    per_node, nodes, ranks = layout.per_node, layout.nodes, layout.ranks
    if not hierarchical or per_node == 1:
        network_alpha = layout.network[1] if nodes > 1 else layout.fabric[1]
        return (encode_s + peer_decode_s * (ranks - 1) + _rounds(ranks) * network_alpha
                + (per_node - 1) * nbytes * _beta(layout.fabric) + per_node * (ranks - per_node) * nbytes
                * _beta(layout.network))
    inside = _allreduce(Layout(1, per_node, layout.fabric, layout.network), dense)
    return (inside + encode_s / per_node + peer_decode_s * (nodes - 1) / per_node
            + _rounds(nodes) * layout.network[1] + (nodes - 1) * nbytes * _beta(layout.network))


def _split_topk(cost: RowCosts, layout: Layout, hierarchical: bool) -> float:
    """``topk_sa``: one selection's bytes out and in per rank, whatever the ranks (see the module)."""
    selection = cost.selection_bytes()
    per_node, nodes, ranks = layout.per_node, layout.nodes, layout.ranks
    if not hierarchical or per_node == 1:
        network_alpha = layout.network[1] if nodes > 1 else layout.fabric[1]
        return (cost.encode_s + cost.decode_s + (ranks - 1 + _rounds(ranks)) * network_alpha
                + 2 * (per_node - 1) / ranks * selection * _beta(layout.fabric)
                + per_node * 2 * (ranks - per_node) / ranks * selection * _beta(layout.network))
    inside = _allreduce(Layout(1, per_node, layout.fabric, layout.network), cost.dense_bytes)
    return (inside + (cost.encode_s + cost.decode_s) / per_node + (nodes - 1 + _rounds(nodes)) * layout.network[1]
            + 2 * (nodes - 1) / nodes * selection * _beta(layout.network))


def _recursive_doubling(cost: RowCosts, layout: Layout, hierarchical: bool) -> float:
    """SparCML's recursive doubling: round t carries the union of 2^t ranks' selections (at most
    the dense tensor); rounds among a node's ranks on the fabric, the others through the link for
    the node's ranks at once."""
    density = min(1.0, cost.bytes_per_step / cost.dense_bytes)
    per_node = layout.per_node
    total = _allreduce(Layout(1, per_node, layout.fabric, layout.network), cost.dense_bytes) if hierarchical else 0.0
    members, inside = 1, not hierarchical
    for _ in range(_rounds(layout.nodes if hierarchical else layout.ranks)):
        union = min(1.0, 1 - (1 - density) ** members) * cost.dense_bytes
        if inside and members < per_node:
            total += layout.fabric[1] + union * _beta(layout.fabric)
        else:  # each rank's exchange (a shard's, when hierarchical) through the node's one link
            total += layout.network[1] + union * (1 if hierarchical else per_node) * _beta(layout.network)
        members *= 2
    return total


def _sparse_mode(cost: RowCosts, layout: Layout, hierarchical: bool) -> float:
    """adaptive's sparse mode: its run's density, but no more bytes than the node's link carries
    while the step computes, nor a quarter of the entries; plus the overhead its sparse steps
    measured beyond their wire time, half encoding (of a shard, when hierarchical), half decoding
    per peer."""
    assert cost.sparse_overhead_s is not None
    beta, entries = _beta(layout.network), cost.dense_bytes / 4
    split = hierarchical and layout.per_node > 1
    carried = (layout.nodes - 1) if split else layout.per_node * (layout.ranks - layout.per_node)
    budget = entries / 4 * cost.bytes_per_nnz
    if carried:
        budget = min(budget, cost.compute_s / beta / carried)
    if cost.sparse_density is not None:
        budget = min(budget, cost.sparse_density * entries * cost.bytes_per_nnz)
    half = cost.sparse_overhead_s / 2
    return cost.compute_s + _allgather(layout, budget, cost.dense_bytes, half, half / max(1, cost.measured_workers - 1),
                                       split)


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
            "per_node": per_node, "node_counts": list(nodes), "points": points,
            "check": check_bytes(result) if result.get("nodes", 1) > 1 else []}


def _anchors(result: dict[str, Any], dense: float) -> dict[tuple[str, bool], tuple[RowCosts, float]]:
    """(preset, hierarchical) → its flat row's costs (the hierarchical projection starts from the
    whole model's bytes) and what its measured step took beyond the model at the run's layout."""
    flat = {row["preset"]: RowCosts.from_row(row, dense) for row in flat_rows(result)}
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


def crossing_bytes(cost: RowCosts, layout: Layout, hierarchical: bool) -> float | None:
    """Bytes the model sends between nodes per step, all nodes together (None: not modeled in
    bytes — SparCML's recursive doubling, `adaptive`'s mix of modes)."""
    nodes, per_node = layout.nodes, layout.per_node
    if cost.kind == "allreduce":
        return cost.collectives * 2 * (nodes - 1) * cost.bytes_per_step
    if cost.kind == "allgather":
        if hierarchical and per_node > 1:
            return nodes * (nodes - 1) * cost.bytes_per_step
        return nodes * per_node * (layout.ranks - per_node) * cost.bytes_per_step
    if cost.kind == "split_topk":
        selection = cost.selection_bytes()
        if hierarchical and per_node > 1:
            return 2 * (nodes - 1) * selection
        return layout.ranks * 2 * (layout.ranks - per_node) / layout.ranks * selection
    return None


def check_bytes(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each row's bytes between nodes as the model sends them at the run's layout, beside what
    crossed its link (``link_bytes_per_step``, headers included)."""
    nodes, dense = result.get("nodes", 1), dense_bytes(result)
    layout = Layout(nodes, result["workers"] // nodes, (math.inf, 0.0), (math.inf, 0.0))
    crossed = {row["preset"]: row.get("link_bytes_per_step") for row in result["rows"]}
    checked = []
    for row in flat_rows(result):
        cost = RowCosts.from_row(row, dense)
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
