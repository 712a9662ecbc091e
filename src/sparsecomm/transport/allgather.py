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
from sparsecomm.payload import as_tensor, decode, encode
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.base import TRANSPORTS, Transport, as_sparse, deliver, output_buffer
from sparsecomm.transport.collectives import Group, allgather_bytes, fingerprint, world
from sparsecomm.transport.request import CallRecord, Reduction, Request
from sparsecomm.transport.session import TransportSession


def codecs_of(request: Request) -> tuple[IndexCodec, ValueCodec]:
    """The pipeline's codecs, or rice indices and fp32 values."""
    return request.index_codec or RiceIndices(), request.value_codec or Float32Values()


def payload_of(sparse: SparseGradient, group: Group, request: Request) -> torch.Tensor:
    """This rank's payload: the one the pipeline (or ``auto``) already encoded, else encoded here."""
    if isinstance(request.payload, torch.Tensor):
        return request.payload
    if request.payload is not None:
        return as_tensor(request.payload)
    index_codec, value_codec = codecs_of(request)
    return as_tensor(encode(sparse, index_codec, value_codec, rng=request.rng(world(group)[0])))


@TRANSPORTS.register("allgather")
@dataclass(frozen=True)
class AllgatherTransport(Transport):
    carries_payloads = True

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        sparse = as_sparse(grad)
        request = request or Request()
        index_codec, value_codec = codecs_of(request)
        config = fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype, index_codec.to_spec(),
                             value_codec.to_spec())
        payload = payload_of(sparse, group, request)
        # the agreement step carries the payload sizes (auto's may not have: then allgather_bytes swaps them)
        counts = agree(group, request, sparse.numel, config, nbytes=payload.numel()).sizes
        record = CallRecord(self.to_spec(), payload.numel())
        total = output_buffer(out, sparse.numel, sparse.dtype)
        gathered = allgather_bytes(payload, group, None if counts is None else list(counts))
        start = time.perf_counter()
        for buffer in gathered:
            received = decode(buffer, expect=sparse.shape)
            total.index_add_(0, received.indices, received.values.to(sparse.dtype))
        record.decode_s = time.perf_counter() - start
        return Reduction(deliver(total, sparse.shape, sparse.device, out), record)
