"""``allgather``: every rank encodes its sparse gradient with the pipeline's codecs, the payloads
are gathered by a variable-length allgather, and every rank decodes and sums them in rank order
(so the sums are bit-identical everywhere). An empty selection is still a valid payload."""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from itertools import chain

import torch

from sparsecomm.encode.base import IndexCodec, ValueCodec, codecs_lossless
from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.encode.value.floats import Float32Values
from sparsecomm.payload import as_tensor, decode, encode
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.base import TRANSPORTS, Transport, as_sparse, deliver, output_buffer
from sparsecomm.transport.collectives import Group, allgather_arrivals, fingerprint, world
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
        record = CallRecord(self.to_spec())
        with record.phase("encode"):
            if request.payload is None:
                sparse = sparse.sorted()  # as encoding needs it, and then this rank's own sum writes in order
            payload = payload_of(sparse, group, request)
        lossless = codecs_lossless(index_codec, value_codec, sparse.dtype)
        record.bytes_sent = payload.numel()
        with record.phase("agreement"):
            # it carries the payload sizes (auto's may not have: then the allgather swaps them)
            sizes = agree(group, request, sparse.numel, config, nbytes=payload.numel()).sizes
        decoded: dict[int, SparseGradient] = {}
        summed = 0  # ranks summed so far: the sum runs in rank order, so every rank adds alike
        with closing(allgather_arrivals(payload, group, None if sizes is None else list(sizes))) as received:
            with record.phase("transfer"):
                own = next(received)  # at once, with the other payloads now in flight
            with record.phase("output"):
                total = output_buffer(out, sparse.numel, sparse.dtype)  # cleared while they travel
            for rank, buffer in chain([own], record.timed(received, "transfer")):
                with record.phase("decode"):
                    # a lossless payload decodes to this rank's own selection: no need to decode it
                    decoded[rank] = sparse if buffer is payload and lossless else decode(buffer, expect=sparse.shape)
                with record.phase("sum"):
                    while summed in decoded:
                        part = decoded.pop(summed)
                        total.index_add_(0, part.indices, part.values.to(sparse.dtype))
                        summed += 1
        with record.phase("output"):
            return Reduction(deliver(total, sparse.shape, sparse.device, out), record)
