"""``allgather``: every rank encodes its sparse gradient with the pipeline's codecs, the payloads
are gathered by a variable-length allgather, and every rank decodes and sums them in rank order
(so the sums are bit-identical everywhere). An empty selection is still a valid payload."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparsecomm.encode.base import IndexCodec, ValueCodec
from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.encode.value.floats import Float32Values
from sparsecomm.errors import SparseCommError
from sparsecomm.payload import as_tensor, decode, encode
from sparsecomm.registry import TRANSPORTS
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.base import ReduceContext, Transport, as_sparse, deliver, output_buffer
from sparsecomm.transport.collectives import Group, agree_and_gather_sizes, allgather_bytes, fingerprint, world


def codecs_of(context: ReduceContext) -> tuple[IndexCodec, ValueCodec]:
    """The pipeline's codecs, or rice indices and fp32 values."""
    return context.index_codec or RiceIndices(), context.value_codec or Float32Values()


def payload_of(sparse: SparseGradient, group: Group, context: ReduceContext) -> torch.Tensor:
    """This rank's payload: the one the pipeline (or ``auto``) already encoded, else encoded here."""
    if isinstance(context.payload, torch.Tensor):
        return context.payload
    if context.payload is not None:
        return as_tensor(context.payload)
    index_codec, value_codec = codecs_of(context)
    return as_tensor(encode(sparse, index_codec, value_codec, rng=context.rng(world(group)[0])))


@TRANSPORTS.register("allgather")
@dataclass(frozen=True)
class AllgatherTransport(Transport):
    carries_payloads = True

    def allreduce(self, grad: SparseGradient | torch.Tensor, group: Group = None,
                  context: ReduceContext | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        sparse = as_sparse(grad)
        context = context or ReduceContext()
        index_codec, value_codec = codecs_of(context)
        config = fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype, index_codec.to_spec(),
                             value_codec.to_spec())
        payload = payload_of(sparse, group, context)
        counts: list[int] | None
        if context.agreed_nnz is None:  # the agreement step rides on the size exchange
            counts = agree_and_gather_sizes(group, sparse.numel, config, payload.numel(), context.nonfinite)
        else:  # the caller (auto) already agreed, maybe carrying the sizes (else allgather_bytes swaps them)
            counts = context.agreed_sizes
        context.bytes_sent += payload.numel()
        context.chosen = self.to_spec()
        total = output_buffer(out, sparse.numel, sparse.dtype)
        gathered = allgather_bytes(payload, group, counts)
        start = time.perf_counter()
        for buffer in gathered:
            received = decode(buffer)
            if received.shape != sparse.shape:
                raise SparseCommError(f"a rank sent shape {tuple(received.shape)}, expected {tuple(sparse.shape)}")
            total.index_add_(0, received.indices, received.values.to(sparse.dtype))
        context.extra["decode_s"] = context.extra.get("decode_s", 0.0) + time.perf_counter() - start
        return deliver(total, sparse.shape, sparse.device, out)
