"""``dense``: the baseline — a plain all_reduce of the whole tensor in fp32, fp16 or bf16."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.registry import TRANSPORTS
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.base import ReduceContext, Transport, agreed, as_dense, deliver
from sparsecomm.transport.collectives import Group, fingerprint

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
                  context: ReduceContext | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        dense = as_dense(grad)
        agreed(group, context, dense.numel(), fingerprint(self.to_spec(), tuple(dense.shape), dense.dtype))
        wire_dtype = WIRE_DTYPES[self.dtype]
        in_place = (out is not None and wire_dtype == dense.dtype == out.dtype and out.device.type == "cpu"
                    and out.is_contiguous() and out.numel() == dense.numel())
        if in_place:
            assert out is not None
            if out.data_ptr() != dense.data_ptr():
                out.copy_(dense.detach().reshape(out.shape))
            wire = out
        else:
            wire = dense.detach().to(wire_dtype).contiguous().clone()
        dist.all_reduce(wire, group=group)
        if context is not None:
            context.bytes_sent += wire.numel() * wire.element_size()
            context.chosen = self.to_spec()
        if in_place:
            return wire
        return deliver(wire.to(dense.dtype).reshape(-1), dense.shape, dense.device, out)
