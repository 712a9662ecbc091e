"""``dense``: the baseline — a plain all_reduce of the whole tensor in fp32, fp16 or bf16."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.registry import TRANSPORTS
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.base import ReduceContext, Transport, as_dense
from sparsecomm.transport.collectives import Group, agree, fingerprint

WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@TRANSPORTS.register("dense")
@dataclass(frozen=True)
class DenseTransport(Transport):
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.dtype not in WIRE_DTYPES:
            raise SparseCommError(f"dense dtype must be one of {', '.join(WIRE_DTYPES)}")

    @property
    def exact(self) -> bool:  # type: ignore[override]
        return self.dtype == "fp32"

    def allreduce(self, grad: SparseGradient | torch.Tensor, group: Group = None,
                  context: ReduceContext | None = None) -> torch.Tensor:
        dense = as_dense(grad)
        agree(group, dense.numel(), fingerprint(self.to_spec(), tuple(dense.shape), dense.dtype),
              nonfinite=bool(context and context.nonfinite))
        wire = dense.detach().to(WIRE_DTYPES[self.dtype]).contiguous().clone()
        dist.all_reduce(wire, group=group)
        if context is not None:
            context.bytes_sent += wire.numel() * wire.element_size()
            context.chosen = self.to_spec()
        return wire.to(dense.dtype).reshape(dense.shape)
