"""``sparse_allreduce``: SparCML's sparse allreduce (§5) over sparse streams with the δ switch.

Algorithms (``algorithm=``):
- ``ssar_rd`` — SSAR recursive doubling: log2 P rounds, partner = rank XOR 2^t, streams summed each
  round. Ranks beyond the largest power of two first fold into a partner and get the result back
  at the end (App. A). Latency-optimal; for small results.
- ``ssar_sa`` — SSAR split-allgather: [0, N) is split into P ranges; each range's entries go to its
  owner (one uneven all-to-all), the owner sums them, then a sparse allgather. For larger results.
  With a session, the ranges are balanced by nonzeros, as Ok-Topk does: each call's ranges split
  the previous call's result (which every rank holds alike) into equal counts, so skewed gradients
  do not load one owner with most of the work.
- ``dsar_sa`` — DSAR split-allgather: as ``ssar_sa`` but each reduced range is sent dense in the
  second phase, optionally QSGD-quantized (``qsgd_bits`` 2/4/8, buckets of ``bucket``) (§6).
- ``topk_sa`` — split-allgather whose owners keep only the largest entries of their summed range,
  ⌈k/P⌉ each (k: the largest selection of any rank), so the result holds about k entries as one
  rank's selection does (a global top-k, as Ok-Topk's): what a rank sends and receives stays about
  twice its own selection at any P, where ``allgather`` receives P − 1 selections and ``ssar_sa``
  the union of P. Not exact: each owner keeps what it dropped of its range (`Reduction.lost`), for
  its error feedback to send again. Its result holds equal counts per range, so it cannot balance
  the next call; instead each owner appends its sums' counts before the cut, in `OWNER_BINS` equal
  parts of its range (int32: 64 bytes), to what it sends on, and with a session the next call's
  ranges split those counts evenly: each owner then sums and cuts a like share.
- ``auto`` — chosen per call by the α-β cost model (`sparsecomm.transport.cost_model`) among the
  exact ones.
Every rank ends with the same bits: each sum is either commutative (two operands) or computed once
by a range's owner and then copied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.encode.value.qsgd import QSGDValues
from sparsecomm.errors import PayloadError, SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.base import TRANSPORTS, Transport, as_sparse, deliver, output_buffer, refused_unless_out_fits
from sparsecomm.transport.collectives import (
    Group,
    Receiver,
    allgather_arrivals,
    alltoall_bytes,
    exchange_bytes,
    fingerprint,
    fresh_buffer,
    host_bytes,
    message_limit,
    recv_bytes,
    send_bytes,
    world,
)
from sparsecomm.transport.cost_model import load_cost_model
from sparsecomm.transport.owner_counts import OWNER_BINS, owner_counts, owner_edges, without_counts
from sparsecomm.transport.request import CallRecord, Reduction, Request
from sparsecomm.transport.session import TransportSession
from sparsecomm.transport.streams import Stream, sum_streams, sum_streams_into

ALGORITHMS = ("auto", "ssar_rd", "ssar_sa", "dsar_sa", "topk_sa")


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
        return self.qsgd_bits == 0 and self.algorithm != "topk_sa"

    def received_per_sent(self, world_size: int) -> float:
        """``topk_sa``: a rank receives its range's parts of every selection, then every owner's
        kept ⌈k/P⌉ entries: about 2(P − 1)/P of its own selection. The exact algorithms carry the
        union of the selections, up to P − 1 others' (the default)."""
        if self.algorithm == "topk_sa":
            return 2 * (world_size - 1) / world_size if world_size > 1 else 1.0
        return super().received_per_sent(world_size)

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        request = request or Request()
        _, size = world(group)
        record = CallRecord(f"sparse_allreduce(algorithm={self.algorithm})")
        with record.phase("encode"):
            sparse = as_sparse(grad).sorted()
        model = (session.cost_model if session else load_cost_model()) if self.algorithm == "auto" else None
        bounds = split_points_of(session, request, sparse.numel, size)
        request = refused_unless_out_fits(request, out, sparse.numel, sparse.dtype)
        with record.phase("agreement"):  # ranks must split alike: their bounds are part of the configuration
            record.agreement = agree(group, request, sparse.numel, fingerprint(
                self.to_spec(), tuple(sparse.shape), sparse.dtype, model.fingerprint() if model else 0, bounds),
                sparse.nnz)
            max_nnz = record.agreement.max_nnz
        algorithm = self.algorithm
        if model is not None:
            algorithm = model.best_sparse_algorithm(size, sparse.numel, max_nnz, sparse.values.element_size(),
                                                    self.qsgd_bits)
            record.transport = f"sparse_allreduce(algorithm={algorithm})"
        stream = Stream.sparse(sparse.indices, sparse.values.detach(), sparse.numel)
        with record.phase("output"):
            total = output_buffer(out, sparse.numel, sparse.dtype, sparse.device)
        receivers = ((session.receiver("split-allgather, all-to-all"), session.receiver("split-allgather, allgather"))
                     if session is not None else (fresh_buffer, fresh_buffer))
        lost = None  # only a quantized dense phase and topk_sa's owners lose anything
        if algorithm == "ssar_rd":
            recursive_doubling(stream, group, record, total)
        elif algorithm in ("topk_sa", "ssar_sa"):
            keep = math.ceil(max_nnz / size) if algorithm == "topk_sa" else None
            counts, lost = split_allgather(stream, group, request, record, total, dense_phase=False, bounds=bounds,
                                           receivers=receivers, keep=keep)
            if session is not None:  # topk_sa's counts are its owners' parts of the call's ranges
                edges = owner_edges(bounds or range_bounds(sparse.numel, size)) if keep is not None else None
                session.split_points[(request.key, sparse.numel, size)] = balanced_bounds(counts, sparse.numel, size,
                                                                                          edges)
        else:
            _, lost = split_allgather(stream, group, request, record, total, dense_phase=True,
                                      qsgd_bits=self.qsgd_bits, bucket=self.bucket, receivers=receivers)
        with record.phase("output"):
            return Reduction(deliver(total, sparse.shape, sparse.device, out), record, lost=lost)


def recursive_doubling(stream: Stream, group: Group, record: CallRecord, total: torch.Tensor) -> None:
    """Sums ``stream`` over the group into ``total`` (flat, zeroed)."""
    rank, size = world(group)
    base = 1 << (size.bit_length() - 1)  # largest power of two ≤ size
    whole = (stream.offset, stream.length)
    device = stream.values.device
    limit = message_limit(stream.length)

    def receive(peer: int) -> Stream:
        with record.phase("transfer"):
            buffer = recv_bytes(peer, group, limit)
        with record.phase("decode"):
            return Stream.from_bytes(buffer, whole, device)

    def send(peer: int) -> None:
        with record.phase("encode"):
            wire = stream.to_bytes()
        record.bytes_sent += wire.numel()
        with record.phase("transfer"):
            send_bytes(wire, peer, group)

    if rank >= base:  # fold into rank - base, get the result back at the end
        send(rank - base)
        result = receive(rank - base)
        with record.phase("output"):
            result.write_into(total)
        return
    if rank < size - base:
        folded = receive(rank + base)
        with record.phase("sum"):
            stream = stream + folded
    distance = 1
    while distance < base:
        with record.phase("encode"):
            wire = stream.to_bytes()
        record.bytes_sent += wire.numel()
        with record.phase("transfer"):
            buffer = exchange_bytes(wire, rank ^ distance, group, limit)
        with record.phase("decode"):
            received = Stream.from_bytes(buffer, whole, device)
        with record.phase("sum"):
            stream = stream + received
        distance <<= 1
    if rank < size - base:
        send(rank + base)
    with record.phase("output"):
        stream.write_into(total)


def split_points_of(session: TransportSession | None, request: Request, numel: int,
                    size: int) -> tuple[int, ...] | None:
    """The range bounds split-allgather uses for this stream: the session's balanced ones, if any."""
    return session.split_points.get((request.key, numel, size)) if session is not None else None


def range_bounds(numel: int, parts: int) -> list[int]:
    return [numel * r // parts for r in range(parts + 1)]


BALANCE_BINS_PER_RANGE = 64
"""resolution of the nonzero counts that split-allgather's ranges are balanced by"""


def nonzero_counts(stream: Stream, numel: int, bins: int) -> torch.Tensor:
    """How many of ``stream``'s entries (a dense stream: all of them) fall in each of ``bins`` equal
    bins of [0, numel)."""
    if stream.indices is not None:
        return torch.bincount((stream.indices + stream.offset) * bins // numel, minlength=bins)
    edges = torch.arange(bins + 1, dtype=torch.int64, device=stream.values.device) * numel // bins
    return (edges[1:].clamp(stream.offset, stream.offset + stream.length)
            - edges[:-1].clamp(stream.offset, stream.offset + stream.length))


def balanced_bounds(counts: torch.Tensor, numel: int, parts: int, edges: torch.Tensor | None = None,
                    ) -> tuple[int, ...]:
    """Range bounds at bin edges that split the counted nonzeros into ``parts`` near-equal shares
    (equal ranges when there is nothing to count); ``edges``: where the bins begin, and the end
    (default: equal bins of [0, numel)).

    Raises:
        PayloadError: a count is negative, or they add up to more than ``numel``.
    """
    counts = counts.cpu()  # a few bins per rank; the bounds are needed on the host
    total = int(counts.sum())
    if total > numel or (counts.numel() and int(counts.min()) < 0):
        raise PayloadError(f"nonzero counts summing to {total} over {counts.numel()} bins cannot split "
                           f"{numel} entries")
    if total == 0:
        return tuple(range_bounds(numel, parts))
    bins = counts.numel()
    if edges is None:
        edges = torch.arange(bins + 1, dtype=torch.int64) * numel // bins
    cumulative = torch.cumsum(counts, 0)
    targets = torch.arange(1, parts, dtype=torch.int64) * total // parts
    edge_bins = torch.searchsorted(cumulative, targets) + 1  # the edge after the bin that reaches each share
    return (0, *edges[edge_bins.clamp(max=bins)].tolist(), numel)


def split_by_range(stream: Stream, bounds: Sequence[int]) -> list[Stream]:
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if stream.indices is None:
            parts.append(Stream(hi - lo, stream.values[lo:hi], None, lo))
            continue
        start, stop = torch.searchsorted(stream.indices, torch.tensor([lo, hi], device=stream.indices.device)).tolist()
        parts.append(Stream.sparse(stream.indices[start:stop] - lo, stream.values[start:stop], hi - lo, lo))
    return parts


def split_allgather(stream: Stream, group: Group, request: Request, record: CallRecord, out: torch.Tensor,
                    dense_phase: bool, qsgd_bits: int = 0, bucket: int = 1024, bounds: tuple[int, ...] | None = None,
                    receivers: tuple[Receiver, Receiver] = (fresh_buffer, fresh_buffer), keep: int | None = None,
                    ) -> tuple[torch.Tensor, SparseGradient | None]:
    """Sums ``stream`` over the group into ``out`` (flat, zeroed), splitting [0, N) at ``bounds``
    (P + 1 ascending positions from 0 to N; default equal ranges). Returns the result's nonzero
    counts in `BALANCE_BINS_PER_RANGE` × P equal bins (with ``keep``: the owners' sums' counts
    before their cut, in `OWNER_BINS` parts of each range), the same on every rank, and, where the
    dense phase quantizes, what the quantization lost of this rank's range (each range's loss kept
    by its owner, so summed over ranks it is all the sum lost: `Reduction.lost`), else None. The
    dense phase sums this rank's range straight into ``out`` (no buffer of the range's size per call);
    ``receivers``: where the all-to-all's and the allgather's messages land. ``keep`` (sparse phase
    only): each owner sends on only this many of its range's summed entries, the largest, and
    returns the others as lost."""
    rank, size = world(group)
    bounds_list = list(bounds) if bounds is not None else range_bounds(stream.length, size)
    if len(bounds_list) != size + 1 or bounds_list[0] != 0 or bounds_list[-1] != stream.length or any(
            lo > hi for lo, hi in zip(bounds_list[:-1], bounds_list[1:], strict=True)):
        raise SparseCommError(f"split bounds {bounds_list} do not split [0, {stream.length}) into {size} ranges")
    bounds = tuple(bounds_list)
    with record.phase("encode"):
        outgoing = [part.to_bytes() for part in split_by_range(stream, bounds)]
    record.bytes_sent += sum(b.numel() for r, b in enumerate(outgoing) if r != rank)
    owned = (bounds[rank], bounds[rank + 1] - bounds[rank])
    with record.phase("transfer"):
        received = alltoall_bytes(outgoing, group, receivers[0], limit=message_limit(stream.length))
    with record.phase("decode"):
        incoming = [Stream.from_bytes(b, owned, stream.values.device) for b in received]
    with record.phase("sum"):  # only the owner sums this range, so every rank gets its bits
        mine = sum_streams_into(incoming, out[owned[0] : owned[0] + owned[1]]) if dense_phase else sum_streams(incoming)
    dropped, cut = None, None
    if keep is not None and not dense_phase:
        with record.phase("sum"):
            cut, (mine, dropped) = mine, largest(mine, keep, stream.length)
    codec = QSGDValues(bits=qsgd_bits, bucket=bucket) if dense_phase and qsgd_bits else None
    refused = ""  # why this rank could not quantize its range: it sends no bytes for it, and every rank raises
    with record.phase("encode"):
        if codec is not None:
            try:
                encoded = codec.encode(mine.values, request.rng(rank))
            except SparseCommError as err:  # a sum past float32's range: every rank's own input was finite
                refused, encoded = str(err), b""
            wire = torch.from_numpy(np.frombuffer(encoded, dtype=np.uint8).copy())
        else:
            wire = mine.to_bytes()
        if cut is not None:  # the kept entries are equal per range: balance by the counts before the cut
            wire = torch.cat([wire, owner_counts(cut).view(torch.uint8).to(wire.device)])
    record.bytes_sent += wire.numel() * (size - 1)
    exact = out[owned[0] : owned[0] + owned[1]].clone() if codec is not None else None
    # each range is written by its owner's bytes alone, so ranges are written as they arrive: this
    # rank's own first, while the others are still in flight
    bins = BALANCE_BINS_PER_RANGE * size
    counts = torch.zeros(size * OWNER_BINS if cut is not None else bins, dtype=torch.int64, device=out.device)
    unquantized = []  # the ranges whose owners could not quantize them
    with closing(allgather_arrivals(wire, group, receiver=receivers[1],
                                    limit=message_limit(stream.length))) as arrivals:
        for owner, buffer in record.timed(arrivals, "transfer"):
            lo, hi = bounds[owner], bounds[owner + 1]
            with record.phase("decode"):
                if owner == rank and dense_phase and codec is None:
                    continue  # the exact sum is in place already
                if codec is not None and buffer.numel() == 0 and hi > lo:  # a range's codes are never empty
                    unquantized.append(owner)
                elif codec is not None:  # this rank's range too: every rank must hold the quantized values
                    codec.decode(host_bytes(buffer).numpy().data, hi - lo, stream.values.dtype, out=out[lo:hi])
                elif cut is not None:
                    body = without_counts(buffer, counts[owner * OWNER_BINS:(owner + 1) * OWNER_BINS])
                    Stream.write_bytes_into(body, (lo, hi - lo), out[lo:hi])
                else:
                    reduced = Stream.write_bytes_into(buffer, (lo, hi - lo), out[lo:hi])
                    counts += nonzero_counts(reduced, stream.length, bins)
    if unquantized:
        raise SparseCommError(f"rank {unquantized[0]} could not quantize its range of the sum of {request.key!r}; no "
                              "rank applied it" + (f" — this one: {refused}" if refused else ""))
    if dropped is not None:
        return counts, dropped
    if exact is None:
        return counts, None
    error = contracting_error(exact, out[owned[0] : owned[0] + owned[1]], bucket)
    where = torch.nonzero(error).squeeze(1)  # zeros quantize to zero: the sum's own support at most
    return counts, SparseGradient(where + owned[0], error[where], torch.Size([stream.length]))


def largest(stream: Stream, keep: int, numel: int) -> tuple[Stream, SparseGradient | None]:
    """``stream``'s ``keep`` entries of largest magnitude, as a sparse stream, and the others (at
    their positions in the whole tensor of ``numel`` entries; None when none is dropped)."""
    indices = stream.indices if stream.indices is not None else torch.arange(stream.length,
                                                                            device=stream.values.device)
    values = stream.values
    if indices.numel() <= keep:
        return stream, None
    chosen = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    chosen[torch.topk(values.abs(), keep, sorted=False).indices] = True
    kept = Stream(stream.length, values[chosen], indices[chosen], stream.offset)  # indices stay sorted
    others = ~chosen & (values != 0)
    return kept, SparseGradient(indices[others] + stream.offset, values[others], torch.Size([numel]))


def contracting_error(exact: torch.Tensor, decoded: torch.Tensor, bucket: int) -> torch.Tensor:
    """exact − decoded in the quantizer's buckets whose error is smaller than what they carry, zero
    elsewhere: QSGD scales a bucket by its L2 norm, and a bucket of many entries of like size, each
    far below the norm, is rounded to 0 or ± the norm's step — more noise than signal, which error
    feedback would send again and compound step by step (as the quantizer alone does not)."""
    error = exact - decoded
    count = exact.numel()
    padding = -count % bucket
    carried = torch.nn.functional.pad(exact.square(), (0, padding)).view(-1, bucket).sum(dim=1)
    lost = torch.nn.functional.pad(error.square(), (0, padding)).view(-1, bucket).sum(dim=1)
    keep = (lost < carried).repeat_interleave(bucket)[:count]
    return error.mul_(keep)
