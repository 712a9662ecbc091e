"""The α-β model of one step over N nodes of G ranks each (P = N·G), the ranks of a node joined by a
fast fabric (NVLink- or PCIe-class) and the nodes by a slower network — two α-β links — for a row
flat (every rank a peer) or hierarchically (`HierarchicalReducer`: dense inside each node, the
preset between nodes on each rank's 1/G shard). An all_reduce row is modeled as NCCL runs it over
nodes, hierarchical already.

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

A hierarchical row whose run recorded sparse gradients (an embedding's rows, `SparseRows`) splits
them off: the rest of the model (D less their dense bytes, B less the row's bytes for them) goes as
above, and the rows as `HierarchicalReducer` sends them, with U(k) the rows k ranks touch in a step
together and R a row's bytes: inside the node an all-gather of each rank's U(1) rows and one of the
U(P)/G averaged rows it owns (at most that many where the sparsifier selects entries from them),
(G−1)·(U(1) + U(P)/G)·R on the fabric; between nodes each rank's U(G)/G
owned rows travel as the flat row sends rows — gathered, the node's link carrying (N−1)·U(G) rows in
the flat row's bytes per row; by recursive doubling, round t the rows of 2^t nodes' union; selected
from as a dense tensor (DGC), each rank's flat selection. adaptive's modes all send the rows at the
bytes per row its run measured (its mix of dense steps, raw, and sparse ones). Flat rows keep the
model above: a payload row's measured bytes hold its rows; adaptive's flat modes and an all_reduce
row send the whole gradient as dense (DDP's bytes are counted so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sparsecomm.train.scaling import RowCosts
from sparsecomm.train.sparse_rows import SparseRows
from sparsecomm.transport.owner_counts import OWNER_COUNTS_BYTES, owner_counts_bytes

SPLIT = ("allgather", "adaptive", "sparse_allreduce", "split_topk")
"""the kinds of row projected hierarchically too: an all_reduce row is modeled as NCCL runs it over
nodes, hierarchical already"""


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
    if _splits_rows(cost, layout, hierarchical):
        return _with_rows(cost, layout)
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


def _splits_rows(cost: RowCosts, layout: Layout, hierarchical: bool) -> bool:
    return hierarchical and layout.per_node > 1 and cost.sparse is not None and cost.kind in SPLIT


def _dense_part(cost: RowCosts) -> RowCosts:
    """``cost`` without its sparse gradients: the rest of the model's bytes, dense and sent."""
    assert cost.sparse is not None
    return replace(cost, bytes_per_step=max(0.0, cost.bytes_per_step - cost.sparse.sent_bytes),
                   dense_bytes=cost.sparse.other_bytes, sparse=None)


def _with_rows(cost: RowCosts, layout: Layout) -> float:
    """A hierarchical step of a row with sparse gradients: the rest as a dense model, the rows as
    `HierarchicalReducer` sends them (see the module)."""
    rows, dense = cost.sparse, _dense_part(cost)
    assert rows is not None
    return step_s(dense, layout, True) + _rows_s(rows, layout)


def _rows_s(rows: SparseRows, layout: Layout) -> float:
    """The two all-gathers of rows inside the node and the owned rows' exchange between nodes."""
    per_node, nodes = layout.per_node, layout.nodes
    inside = 2 * _rounds(per_node) * layout.fabric[1] + rows.inside_bytes(per_node, layout.ranks) * _beta(layout.fabric)
    if rows.travel == "doubling":
        return inside + sum(layout.network[1] + rows.node_share(per_node, 2**t) * _beta(layout.network)
                            for t in range(_rounds(nodes)))
    return inside + _rounds(nodes) * layout.network[1] + (nodes - 1) * rows.node_share(per_node) * _beta(layout.network)


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
        counts = OWNER_COUNTS_BYTES  # an owner's counts, to each other rank
        return (cost.encode_s + cost.decode_s + (ranks - 1 + _rounds(ranks)) * network_alpha
                + (2 * (per_node - 1) / ranks * selection + (per_node - 1) * counts) * _beta(layout.fabric)
                + per_node * (2 * (ranks - per_node) / ranks * selection + (ranks - per_node) * counts)
                * _beta(layout.network))
    inside = _allreduce(Layout(1, per_node, layout.fabric, layout.network), cost.dense_bytes)
    return (inside + (cost.encode_s + cost.decode_s) / per_node + (nodes - 1 + _rounds(nodes)) * layout.network[1]
            + (2 * (nodes - 1) / nodes * selection + per_node * owner_counts_bytes(nodes)) * _beta(layout.network))


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


def crossing_bytes(cost: RowCosts, layout: Layout, hierarchical: bool) -> float | None:
    """Bytes the model sends between nodes per step, all nodes together (None: not modeled in
    bytes — SparCML's recursive doubling, `adaptive`'s mix of modes)."""
    nodes, per_node = layout.nodes, layout.per_node
    if _splits_rows(cost, layout, hierarchical):
        assert cost.sparse is not None
        dense = crossing_bytes(_dense_part(cost), layout, True)
        rows = None if cost.sparse.travel == "doubling" else nodes * (nodes - 1) * cost.sparse.node_share(per_node)
        return None if dense is None or rows is None else dense + rows
    if cost.kind == "allreduce":
        return cost.collectives * 2 * (nodes - 1) * cost.bytes_per_step
    if cost.kind == "allgather":
        if hierarchical and per_node > 1:
            return nodes * (nodes - 1) * cost.bytes_per_step
        return nodes * per_node * (layout.ranks - per_node) * cost.bytes_per_step
    if cost.kind == "split_topk":
        selection, ranks = cost.selection_bytes(), layout.ranks
        if hierarchical and per_node > 1:
            return 2 * (nodes - 1) * selection + ranks * owner_counts_bytes(nodes)
        return ranks * (2 * (ranks - per_node) / ranks * selection + (ranks - per_node) * OWNER_COUNTS_BYTES)
    return None


def inside_bytes(cost: RowCosts, layout: Layout, hierarchical: bool) -> float | None:
    """Bytes a rank sends to its node's ranks per step, hierarchically (ring-counted, as
    `HierarchicalReducer.node_bytes` counts them): the dense reduce-scatter and all-gather, and a
    sparse gradient's two all-gathers of rows (None: flat, or a kind not projected hierarchically)."""
    if not hierarchical or cost.kind not in SPLIT:
        return None
    per_node = layout.per_node
    dense = cost.dense_bytes if cost.sparse is None else cost.sparse.other_bytes
    rows = 0.0 if cost.sparse is None else cost.sparse.inside_bytes(per_node, layout.ranks)
    return 2 * (per_node - 1) / per_node * dense + rows
