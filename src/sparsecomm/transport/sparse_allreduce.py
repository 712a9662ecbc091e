"""``sparse_allreduce``: SparCML's sparse allreduce (§5) over sparse streams with the δ switch.

Algorithms (``algorithm=``):
- ``ssar_rd`` — SSAR recursive doubling: log2 P rounds, partner = rank XOR 2^t, streams summed each
  round. Ranks beyond the largest power of two first fold into a partner and get the result back
  at the end (App. A). Latency-optimal; for small results.
- ``ssar_sa`` — SSAR split-allgather: [0, N) is split into P ranges; each range's entries go to its
  owner (one uneven all-to-all), the owner sums them, then a sparse allgather. For larger results.
- ``dsar_sa`` — DSAR split-allgather: as ``ssar_sa`` but each reduced range is sent dense in the
  second phase, optionally QSGD-quantized (``qsgd_bits`` 2/4/8, buckets of ``bucket``) (§6).
- ``auto`` — chosen per call by the α-β cost model (`sparsecomm.transport.cost_model`).
Every rank ends with the same bits: each sum is either commutative (two operands) or computed once
by a range's owner and then copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.encode.value.qsgd import QSGDValues
from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.base import TRANSPORTS, Transport, as_sparse, deliver, output_buffer
from sparsecomm.transport.collectives import (
    Group,
    allgather_bytes,
    alltoall_bytes,
    exchange_bytes,
    fingerprint,
    recv_bytes,
    send_bytes,
    world,
)
from sparsecomm.transport.cost_model import load_cost_model
from sparsecomm.transport.request import CallRecord, Reduction, Request
from sparsecomm.transport.session import TransportSession
from sparsecomm.transport.streams import Stream, sum_streams

ALGORITHMS = ("auto", "ssar_rd", "ssar_sa", "dsar_sa")


@TRANSPORTS.register("sparse_allreduce")
@dataclass(frozen=True)
class SparseAllreduce(Transport):
    algorithm: str = "auto"
    qsgd_bits: int = 0
    """0: the dense phase of dsar_sa is exact; 2, 4 or 8: QSGD-quantized."""
    bucket: int = 1024

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise SparseCommError(f"sparse_allreduce algorithm must be one of {', '.join(ALGORITHMS)}")
        if self.qsgd_bits not in (0, 2, 4, 8):
            raise SparseCommError("sparse_allreduce qsgd_bits must be 0, 2, 4 or 8")

    @property
    def exact(self) -> bool:  # type: ignore[override]
        return self.qsgd_bits == 0

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        sparse = as_sparse(grad).sorted()
        request = request or Request()
        rank, size = world(group)
        model = (session.cost_model if session else load_cost_model()) if self.algorithm == "auto" else None
        max_nnz = agree(group, request, sparse.numel, fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype,
                                                                  model.fingerprint() if model else 0),
                        sparse.nnz).max_nnz
        algorithm = self.algorithm
        if model is not None:
            algorithm = model.best_sparse_algorithm(size, sparse.numel, max_nnz, sparse.values.element_size(),
                                                    self.qsgd_bits)
        record = CallRecord(f"sparse_allreduce(algorithm={algorithm})")
        values = sparse.values.detach().cpu()
        stream = Stream.sparse(sparse.indices.cpu(), values, sparse.numel)
        total = output_buffer(out, sparse.numel, sparse.dtype)
        if algorithm == "ssar_rd":
            recursive_doubling(stream, group, record, total)
        elif algorithm == "ssar_sa":
            split_allgather(stream, group, request, record, total, dense_phase=False)
        else:
            split_allgather(stream, group, request, record, total, dense_phase=True, qsgd_bits=self.qsgd_bits,
                            bucket=self.bucket)
        return Reduction(deliver(total, sparse.shape, sparse.device, out), record)


def recursive_doubling(stream: Stream, group: Group, record: CallRecord, total: torch.Tensor) -> None:
    """Sums ``stream`` over the group into ``total`` (flat, zeroed)."""
    rank, size = world(group)
    base = 1 << (size.bit_length() - 1)  # largest power of two ≤ size
    whole = (stream.offset, stream.length)
    if rank >= base:  # fold into rank - base, get the result back at the end
        partner = rank - base
        send_bytes(stream.to_bytes(), partner, group)
        record.bytes_sent += stream.wire_bytes()
        Stream.from_bytes(recv_bytes(partner, group), whole).write_into(total)
        return
    if rank < size - base:
        stream = stream + Stream.from_bytes(recv_bytes(rank + base, group), whole)
    distance = 1
    while distance < base:
        wire = stream.to_bytes()
        record.bytes_sent += wire.numel()
        received = Stream.from_bytes(exchange_bytes(wire, rank ^ distance, group), whole)
        stream = stream + received
        distance <<= 1
    if rank < size - base:
        wire = stream.to_bytes()
        record.bytes_sent += wire.numel()
        send_bytes(wire, rank + base, group)
    stream.write_into(total)


def range_bounds(numel: int, parts: int) -> list[int]:
    return [numel * r // parts for r in range(parts + 1)]


def split_by_range(stream: Stream, bounds: list[int]) -> list[Stream]:
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if stream.indices is None:
            parts.append(Stream(hi - lo, stream.values[lo:hi], None, lo))
            continue
        start, stop = torch.searchsorted(stream.indices, torch.tensor([lo, hi])).tolist()
        parts.append(Stream.sparse(stream.indices[start:stop] - lo, stream.values[start:stop], hi - lo, lo))
    return parts


def split_allgather(stream: Stream, group: Group, request: Request, record: CallRecord, out: torch.Tensor,
                    dense_phase: bool, qsgd_bits: int = 0, bucket: int = 1024) -> None:
    """Sums ``stream`` over the group into ``out`` (flat, zeroed)."""
    rank, size = world(group)
    bounds = range_bounds(stream.length, size)
    outgoing = [part.to_bytes() for part in split_by_range(stream, bounds)]
    record.bytes_sent += sum(b.numel() for r, b in enumerate(outgoing) if r != rank)
    owned = (bounds[rank], bounds[rank + 1] - bounds[rank])
    incoming = [Stream.from_bytes(b, owned) for b in alltoall_bytes(outgoing, group)]
    mine = sum_streams(incoming)  # only the owner sums this range, so every rank gets its bits
    if dense_phase:
        mine = Stream(mine.length, mine.to_dense(), None, mine.offset)
    if dense_phase and qsgd_bits:
        codec = QSGDValues(bits=qsgd_bits, bucket=bucket)
        wire = torch.from_numpy(np.frombuffer(codec.encode(mine.values, request.rng(rank)), dtype=np.uint8).copy())
    else:
        wire = mine.to_bytes()
    record.bytes_sent += wire.numel() * (size - 1)
    for owner, buffer in enumerate(allgather_bytes(wire, group)):
        lo, hi = bounds[owner], bounds[owner + 1]
        if dense_phase and qsgd_bits:
            out[lo:hi] = QSGDValues(bits=qsgd_bits, bucket=bucket).decode(
                memoryview(buffer.numpy().tobytes()), hi - lo, stream.values.dtype)
        else:
            Stream.from_bytes(buffer, (lo, hi - lo)).write_into(out[lo:hi])
