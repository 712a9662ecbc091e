"""A model's sparse gradients (``Embedding(sparse=True)``: lm's embedding) as a `sparsecomm train`
run records them for the node projection (`sparsecomm.train.node_model`), which sends them as
`HierarchicalReducer` does — by rows, not as a dense tensor.

The run's field `FIELD` holds the fp32 bytes of those parameters and of the rest of the model, a
row's bytes as a node's all-gathers send it (int64 index and values, `sparsecomm.reducer.node_rows`),
and the rows a step touches on k ranks together: the distinct indices the sparse modules read in one
step's forward passes of `SAMPLED_RANKS` ranks' batches, the mean over groups of k ranks. Each row
of the run adds the bytes a rank sent per step for those parameters (``sparse_bytes_per_step``). A
run without the field has no sparse part: the projection sends its whole gradient as dense.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparsecomm.presets import resolve
from sparsecomm.train.baselines import BASELINES

FIELD = "sparse_gradients"
"""the run JSON's field (absent: no parameter's gradient is sparse)"""
SAMPLED_RANKS = 256
"""the ranks whose batches are sampled: the largest layout projected, 32 nodes of 8"""


class _Read(Exception):
    """Every sparse module of the model has read its indices in this forward pass."""


def sparse_parameters(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters whose gradients are sparse, as the reducer's streams name
    them (a DDP model's module's names)."""
    module = getattr(model, "module", model)
    return [f"{prefix}.{name}" if prefix else name for prefix, each in module.named_modules()
            if getattr(each, "sparse", False) is True for name, _ in each.named_parameters(recurse=False)]


def record(task: Any, batch: int, seed: int) -> dict[str, Any] | None:
    """The run's `FIELD` for ``task`` (a workload) at ``batch`` a rank, or None where no gradient
    of its model is sparse. Forward passes on the CPU, each stopped once every sparse module has
    read its indices (a module read twice in a pass counts its first read)."""
    model = task.model(seed)
    modules = [each for each in model.modules() if getattr(each, "sparse", False) is True]
    if not modules:
        return None
    offsets, start = {}, 0
    for each in modules:  # one row space for all of them: module m's row r is start_m + r
        offsets[id(each)], start = start, start + each.weight.shape[0]
    read: dict[int, torch.Tensor] = {}

    def remember(module: nn.Module, inputs: tuple[Any, ...]) -> None:
        read[id(module)] = inputs[0].reshape(-1) + offsets[id(module)]
        if len(read) == len(modules):  # every sparse module has read its rows: the rest of the pass is not needed
            raise _Read

    hooks = [each.register_forward_pre_hook(remember) for each in modules]
    touched = []
    try:
        with torch.no_grad():
            for rank in range(SAMPLED_RANKS):
                with contextlib.suppress(_Read):
                    task.loss(model, next(iter(task.batches(rank, SAMPLED_RANKS, 1, batch, seed))))
                touched.append(torch.cat([*read.values(), torch.zeros(0, dtype=torch.int64)]).unique())
                read.clear()
    finally:
        for hook in hooks:
            hook.remove()
    rows, ranks = {}, 1
    while ranks <= SAMPLED_RANKS:
        groups = [torch.cat(touched[i:i + ranks]).unique().numel() for i in range(0, SAMPLED_RANKS, ranks)]
        rows[str(ranks)] = round(sum(groups) / len(groups), 1)
        ranks *= 2
    weights = [each.weight for each in modules]
    sparse_numel = sum(w.numel() for w in weights)
    row_bytes = sum(8 + w[0].numel() * w.element_size() for w in weights) / len(weights)
    return {"parameters": sparse_parameters(model), "dense_bytes": 4 * sparse_numel,
            "other_bytes": 4 * (sum(p.numel() for p in model.parameters()) - sparse_numel),
            "row_bytes": row_bytes, "total_rows": start, "rows": rows}


@dataclass(frozen=True)
class SparseRows:
    """One row's sparse gradients in the node projection: what its run recorded (`record`) and how
    the row's preset sends them between nodes (``travel``):

    - ``allgather``: row by row, each rank's payload gathered (its transport, or the allgather that
      stands in for an inexact one);
    - ``doubling``: row by row through an exact ``sparse_allreduce`` (recursive doubling: round t
      carries the union of 2^t members' rows);
    - ``selected``: its sparsifier selects from the dense tensor the rows stand for (DGC), so a rank
      sends what it sent flat, whatever rows it owns.
    """

    dense_bytes: float
    other_bytes: float
    """the rest of the model: its dense gradient's fp32 bytes"""
    row_bytes: float
    total_rows: int
    touched: tuple[tuple[int, float], ...]
    """(ranks, rows their batches touch in one step), by ranks"""
    sent_bytes: float
    """a rank's bytes for them per step in the flat row"""
    travel: str = "allgather"

    @classmethod
    def of(cls, field: dict[str, Any] | None, row: dict[str, Any]) -> SparseRows | None:
        """``row``'s sparse part, from its run's `FIELD` (None: the run has none, or the row is one of
        PyTorch's, which sends them as it sends a dense gradient)."""
        if not field or row["preset"] in BASELINES:
            return None
        touched = tuple(sorted((int(k), float(v)) for k, v in field["rows"].items()))
        spec = resolve(row["preset"])
        if spec.sparsifier.selects_rows():
            travel = "selected"
        elif spec.transport.name == "sparse_allreduce" and spec.transport.exact:
            travel = "doubling"
        else:
            travel = "allgather"
        sent = row.get("sparse_bytes_per_step")
        return cls(field["dense_bytes"], field["other_bytes"], field["row_bytes"], field["total_rows"], touched,
                   touched[0][1] * field["row_bytes"] if sent is None else sent, travel)

    def rows(self, ranks: int) -> float:
        """Rows ``ranks`` ranks touch in a step together: between sampled counts log-linearly, beyond
        them in proportion, never more than the parameters hold."""
        counts = dict(self.touched)
        if ranks in counts:
            return counts[ranks]
        below = max((k for k in counts if k < ranks), default=None)
        above = min((k for k in counts if k > ranks), default=None)
        if below is None:
            return counts[min(counts)] * ranks / min(counts)
        if above is None:
            return min(float(self.total_rows), counts[below] * ranks / below)
        share = math.log2(ranks / below) / math.log2(above / below)
        return counts[below] + share * (counts[above] - counts[below])

    def payload_per_row(self) -> float:
        """Bytes a row takes in the flat row's payloads: its measured bytes over its rows."""
        return self.sent_bytes / max(1.0, self.rows(1))

    def inside_bytes(self, per_node: int, ranks: int) -> float:
        """A rank's bytes to its node's ranks per step: its own rows to every peer, then the rows it
        owns averaged over all ``ranks`` (a 1/``per_node`` share of their union) to every peer."""
        return (per_node - 1) * (self.rows(1) + self.rows(ranks) / per_node) * self.row_bytes

    def node_share(self, per_node: int, members: int = 1) -> float:
        """Bytes a node's ranks send together between nodes per exchange: their rows of the union of
        ``members`` nodes (the node's own: 1) in the flat row's bytes per row; ``selected``: each
        rank's flat selection."""
        if self.travel == "selected":
            return per_node * self.sent_bytes
        return self.rows(per_node * members) * self.payload_per_row()
