"""``auto``: picks, per call, the exact transport the α-β cost model predicts fastest — dense
all_reduce, payload allgather, or one of SparCML's sparse allreduce algorithms — from N, the
largest nnz on any rank, P and the measured codec speed. All ranks decide from agreed numbers and
the same cost model (checked), so they always choose alike."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.encode.value.floats import Float32Values
from sparsecomm.registry import TRANSPORTS
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.allgather import AllgatherTransport
from sparsecomm.transport.base import ReduceContext, Transport, as_sparse
from sparsecomm.transport.collectives import Group, agree, fingerprint, world
from sparsecomm.transport.cost_model import CostModel, load_cost_model
from sparsecomm.transport.dense import DenseTransport
from sparsecomm.transport.sparse_allreduce import SparseAllreduce

VALUE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}


def estimated_payload_bytes_per_nnz(context: ReduceContext, numel: int, nnz: int) -> float:
    """A cheap size estimate for the pipeline's codecs (gap codes: about log2(N/k) + 1.5 bits)."""
    index_name = (context.index_codec or RiceIndices()).name
    value_name = (context.value_codec or Float32Values()).name
    gap_bytes = (math.log2(max(1.0, numel / max(nnz, 1))) + 1.5) / 8
    index_bytes = {"raw": 4.0, "bitmap": numel / 8 / max(nnz, 1)}.get(index_name, gap_bytes)
    return index_bytes + VALUE_BYTES.get(value_name, 4.0)


def choose(model: CostModel, workers: int, numel: int, nnz: int, isize: int,
           payload_bytes_per_nnz: float) -> tuple[str, dict[str, float]]:
    costs = {"dense": model.dense(workers, numel, isize),
             "allgather": model.allgather(workers, numel, nnz, payload_bytes_per_nnz)}
    costs.update(model.sparse_algorithms(workers, numel, nnz, isize))
    return min(costs, key=costs.__getitem__), costs


@TRANSPORTS.register("auto")
@dataclass(frozen=True)
class AutoTransport(Transport):
    def allreduce(self, grad: SparseGradient | torch.Tensor, group: Group = None,
                  context: ReduceContext | None = None) -> torch.Tensor:
        sparse = as_sparse(grad)
        context = context or ReduceContext()
        _, workers = world(group)
        model = load_cost_model()
        max_nnz = agree(group, sparse.numel, fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype,
                                                         model.fingerprint()), sparse.nnz)
        best, costs = choose(model, workers, sparse.numel, max_nnz, sparse.values.element_size(),
                             estimated_payload_bytes_per_nnz(context, sparse.numel, max_nnz))
        context.extra.update({f"predicted_{name}_ms": 1e3 * cost for name, cost in costs.items()})
        transport: Transport
        if best == "dense":
            transport = DenseTransport()
        elif best == "allgather":
            transport = AllgatherTransport()
        else:
            transport = SparseAllreduce(algorithm=best)
        return transport.allreduce(sparse, group, context)
