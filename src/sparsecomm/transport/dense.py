"""``dense``: the baseline — a plain all_reduce of the whole tensor in fp32, fp16 or bf16, on the
backend's device (in place in ``out`` when that is where the wire is)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.base import TRANSPORTS, Transport, as_dense, deliver, refused_unless_out_fits
from sparsecomm.transport.collectives import Group, fingerprint, wire_device
from sparsecomm.transport.request import CallRecord, Reduction, Request
from sparsecomm.transport.session import TransportSession

WIRE_DTYPES = MappingProxyType({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16})


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

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        dense = as_dense(grad)
        record = CallRecord(self.to_spec())
        request = refused_unless_out_fits(request or Request(), out, dense.numel(), None)  # deliver casts
        with record.phase("agreement"):
            record.agreement = agree(group, request, dense.numel(),
                                     fingerprint(self.to_spec(), tuple(dense.shape), dense.dtype))
        wire_dtype, device = WIRE_DTYPES[self.dtype], wire_device(group)
        in_place = (out is not None and wire_dtype == dense.dtype == out.dtype and out.device == device
                    and out.is_contiguous() and out.numel() == dense.numel())
        with record.phase("encode"):
            if in_place:
                assert out is not None
                if out.data_ptr() != dense.data_ptr():
                    out.copy_(dense.detach().reshape(out.shape))
                wire = out
            else:
                wire = dense.detach().to(device, wire_dtype, copy=True).contiguous()
        with record.phase("transfer"):
            dist.all_reduce(wire, group=group)
        record.bytes_sent = wire.numel() * wire.element_size()
        if in_place:
            return Reduction(wire, record)
        with record.phase("output"):
            return Reduction(deliver(wire.to(dense.dtype).reshape(-1), dense.shape, dense.device, out), record)
