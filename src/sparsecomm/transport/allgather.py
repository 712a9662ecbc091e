"""``allgather``: every rank encodes its sparse gradient with the pipeline's codecs, the payloads
are gathered by a variable-length allgather, and every rank decodes and sums them in rank order
(so the sums are bit-identical everywhere). An empty selection is still a valid payload.

With a `TransportSession` on gloo, a call is one round: each payload travels behind its agreement
record (`sparsecomm.transport.payload_exchange`), and every rank checks every record before it
returns. Without one, on NCCL (whose receives must match their messages' sizes), or when ``auto``
already ran the agreement step, the agreement step's all_gather carries the sizes and the payloads
follow. Payloads are decoded on the host and scattered into the sum on the gradient's device.

`AllgatherTransport.reduce_fused` exchanges several streams' calls at once: each rank's payloads
go in one message behind one agreement record that names every stream and call (Horovod's tensor
fusion, for variable-length payloads), so a step of small calls pays one exchange's fixed cost,
and every sum is the one its own call would give."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import closing, suppress
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from sparsecomm.encode.base import IndexCodec, ValueCodec, codecs_lossless
from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.encode.value.floats import Float32Values
from sparsecomm.errors import PayloadError, SparseCommError
from sparsecomm.host_memory import write_at
from sparsecomm.payload import as_tensor, decode, encode
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import NBYTES_FIELD, agree, agreement_record, check_table
from sparsecomm.transport.base import TRANSPORTS, Transport, as_sparse, check_out, deliver, output_buffer
from sparsecomm.transport.collectives import (
    Group,
    Receiver,
    allgather_arrivals,
    fingerprint,
    fresh_buffer,
    host_bytes,
    message_limit,
    takes_short_messages,
    world,
)
from sparsecomm.transport.payload_exchange import PayloadExchange, next_capacity
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


def payload_or_refusal(sparse: SparseGradient, group: Group, request: Request) -> tuple[torch.Tensor, Request]:
    """(`payload_of`, the request), or where a codec cannot encode this rank's values (fp16's range)
    an empty payload of the same codecs and the request marked ``refused``: the agreement step then
    raises on every rank, where a refusal here would leave the others waiting for this payload."""
    try:
        return payload_of(sparse, group, request), request
    except SparseCommError as refused:
        nothing = SparseGradient(sparse.indices[:0], sparse.values[:0], sparse.shape)
        return payload_of(nothing, group, request), replace(request, refused=str(refused))


class RankOrderSum:
    """Contributions added to ``total`` in rank order as they become available, so every rank adds
    the same numbers in the same order and gets the same bits. Ranks 0 and 1 may come in either
    order: adding to the zeroed buffer is exact (up to a zero's sign, which the second addition
    settles the same either way) and IEEE addition commutes, so 0 + a + b and 0 + b + a are equal
    bits. Rank 1 thus adds its own contribution while rank 0's travels. The first contribution is
    written, not added (faster on the host), as ``a + 0.0``: the same bits as 0 + a, a negative
    zero included."""

    def __init__(self, total: torch.Tensor) -> None:
        self.total = total
        self._waiting: dict[int, SparseGradient] = {}
        self._added: set[int] = set()
        self._lowest_missing = 0

    def add(self, rank: int, part: SparseGradient) -> None:
        self._waiting[rank] = part
        while (ready := self._ready()) is not None:
            part = self._waiting.pop(ready)
            if self._added:
                self.total.scatter_add_(0, part.indices, part.values.to(self.total.dtype))
            else:  # cast by write_at: + 0.0 only turns -0.0 into 0.0, in any dtype
                write_at(self.total, part.indices, part.values + 0.0)
            self._added.add(ready)
            while self._lowest_missing in self._added:
                self._lowest_missing += 1

    def _ready(self) -> int | None:
        if self._lowest_missing in self._waiting:
            return self._lowest_missing
        if not self._added and 1 in self._waiting:
            return 1
        return None


@TRANSPORTS.register("allgather")
@dataclass(frozen=True)
class AllgatherTransport(Transport):
    carries_payloads = True

    def prepare(self, group: Group, session: TransportSession) -> None:
        """The one-way group its one-round exchanges use on gloo (`TransportSession.one_way_group`):
        made by the first call otherwise, ~11 ms of that call."""
        if takes_short_messages(group):
            session.one_way_group(group)

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        request = request or Request()
        record = CallRecord(self.to_spec())
        exchange = None
        if session is not None and request.agreement is None and takes_short_messages(group):
            exchange = _session_exchange(session, group)  # the peers' messages may arrive while this rank encodes
        try:
            sparse, payload, config, own, request = self._encoded(grad, group, request, record)
            check_out(out, sparse.numel, sparse.dtype)
        except BaseException as err:
            _refuse(exchange, group, request, err)
            raise
        if exchange is None:
            receiver = session.receiver("payloads") if session is not None else fresh_buffer
            total = self._in_two_rounds(sparse, own, payload, group, request, config, out, record, receiver)
        else:
            assert session is not None
            total = self._in_one_round(sparse, own, payload, group, request, config, out, record, session, exchange)
        with record.phase("output"):
            return Reduction(deliver(total, sparse.shape, sparse.device, out), record)

    def reduce_fused(self, calls: Sequence[FusedCall], group: Group = None,
                     session: TransportSession | None = None) -> list[Reduction]:
        """Each call's `reduce`, in one exchange: this rank's payloads in one message behind one
        agreement record for them all (`fused_message`, `fused_request`). Every rank must pass the
        same streams in the same order, or every rank raises naming them. Without a session on
        gloo (NCCL's receives must match their messages), or for a single call, the calls run one
        by one."""
        if (len(calls) == 1 or session is None or not takes_short_messages(group)
                or any(call.request.agreement is not None for call in calls)):
            return [self.reduce(call.grad, group, call.request, call.out, session) for call in calls]
        exchange = _session_exchange(session, group)
        records = [CallRecord(self.to_spec()) for _ in calls]
        try:
            encoded = [self._encoded(call.grad, group, call.request, record)
                       for call, record in zip(calls, records, strict=True)]
            sparses, payloads, configs, owns, requests = (list(column) for column in zip(*encoded, strict=True))
            for call, sparse in zip(calls, sparses, strict=True):
                check_out(call.out, sparse.numel, sparse.dtype)
            request = fused_request(requests)
            message = fused_message(payloads)
        except BaseException as err:
            _refuse(exchange, group, fused_request([call.request for call in calls], check=False), err)
            raise
        numel, config = sum(sparse.numel for sparse in sparses), fingerprint(*configs)
        envelope = agreement_record(request, numel, config, sum(sparse.nnz for sparse in sparses), message.numel())
        rank = world(group)[0]
        with closing(exchange):
            exchange.send(envelope, message)
            totals = []
            for call, sparse, record in zip(calls, sparses, records, strict=True):
                with record.phase("output"):  # cleared while the messages travel
                    totals.append(output_buffer(call.out, sparse.numel, sparse.dtype, sparse.device))
            summing = [RankOrderSum(total) for total in totals]

            def add(sender: int, buffer: torch.Tensor) -> None:
                parts = split_message(buffer, [sparse.numel for sparse in sparses])
                for i, part in enumerate(parts):
                    _add(summing[i], sender, part, owns[i] if sender == rank else None, sparses[i].shape, records[i])

            for sender, peer, buffer in records[0].timed(exchange.first_round(), "transfer"):
                # as `_in_one_round`: what another call sent, or after a non-finite gradient, is not read
                if buffer is not None and bool((peer[:4] == envelope[:4]).all()) and not bool(peer[5]):
                    add(sender, buffer)
            with records[0].phase("agreement"):
                agreement = check_table(exchange.table, request, numel, config)
                sizes = exchange.table[:, NBYTES_FIELD].tolist()
                _check_sizes(sizes, numel, parts=len(calls))
            # every rank holds these sizes now: the next capacity stays one number even where a
            # payload then fails to decode on some ranks only
            session.payload_capacity = next_capacity(session.payload_capacity, sizes)
            for sender, buffer in records[0].timed(exchange.second_round(), "transfer"):
                add(sender, buffer)
        reductions = []
        for call, sparse, record, total in zip(calls, sparses, records, totals, strict=True):
            record.agreement = agreement
            with record.phase("output"):
                reductions.append(Reduction(deliver(total, sparse.shape, sparse.device, call.out), record))
        return reductions

    def _encoded(self, grad: SparseGradient | torch.Tensor, group: Group, request: Request,
                 record: CallRecord) -> tuple[SparseGradient, torch.Tensor, int, SparseGradient | None, Request]:
        """(the contribution, sorted; this rank's payload; the call's configuration fingerprint; what
        its own payload decodes to, where known without decoding it; the request, ``refused`` where
        a codec could not encode the values — `payload_or_refusal`)."""
        sparse = as_sparse(grad)
        index_codec, value_codec = codecs_of(request)
        config = fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype, index_codec.to_spec(),
                             value_codec.to_spec(), request.caller_config)
        with record.phase("encode"):
            if request.payload is None:
                sparse = sparse.sorted()  # as encoding needs it, and then this rank's own sum writes in order
            payload, request = payload_or_refusal(sparse, group, request)
        record.bytes_sent = payload.numel()
        # a lossless payload decodes to this rank's own selection, and so does a pipeline's payload
        # (its selection holds the values as decoded): no need to decode it
        exact = codecs_lossless(index_codec, value_codec, sparse.dtype)
        own = sparse if exact or (request.payload is not None and request.payload_is_contribution) else None
        return sparse, payload, config, own, request

    @staticmethod
    def _in_one_round(sparse: SparseGradient, own: SparseGradient | None, payload: torch.Tensor, group: Group,
                      request: Request, config: int, out: torch.Tensor | None, record: CallRecord,
                      session: TransportSession, exchange: PayloadExchange) -> torch.Tensor:
        """Payloads behind their agreement records (`PayloadExchange`, its receives posted); the table
        checked once all records are in, before anything late is received or the sum returned."""
        envelope = agreement_record(request, sparse.numel, config, sparse.nnz, payload.numel())
        with closing(exchange):
            exchange.send(envelope, payload)
            with record.phase("output"):
                # cleared while the messages travel
                total = output_buffer(out, sparse.numel, sparse.dtype, sparse.device)
            summing = RankOrderSum(total)
            for rank, peer, buffer in record.timed(exchange.first_round(), "transfer"):
                # a payload for another tensor or call, or after a non-finite gradient, is not read:
                # the table check below fails on every rank
                if buffer is not None and bool((peer[:4] == envelope[:4]).all()) and not bool(peer[5]):
                    _add(summing, rank, buffer, own if buffer is payload else None, sparse.shape, record)
            with record.phase("agreement"):
                table = exchange.table
                record.agreement = check_table(table, request, sparse.numel, config)
                sizes = table[:, NBYTES_FIELD].tolist()
                _check_sizes(sizes, sparse.numel)
            session.payload_capacity = next_capacity(session.payload_capacity, sizes)  # as in `reduce_fused`
            for rank, buffer in record.timed(exchange.second_round(), "transfer"):
                _add(summing, rank, buffer, None, sparse.shape, record)
        return total

    @staticmethod
    def _in_two_rounds(sparse: SparseGradient, own: SparseGradient | None, payload: torch.Tensor, group: Group,
                       request: Request, config: int, out: torch.Tensor | None, record: CallRecord,
                       receiver: Receiver) -> torch.Tensor:
        """The agreement step (which carries the sizes, unless ``auto`` ran it), then the payloads."""
        with record.phase("agreement"):
            record.agreement = agree(group, request, sparse.numel, config, sparse.nnz, payload.numel())
            sizes = record.agreement.sizes
            if sizes is not None:  # the same table on every rank: refused on every rank alike
                _check_sizes(list(sizes), sparse.numel)
        with closing(allgather_arrivals(payload, group, None if sizes is None else list(sizes), receiver,
                                        limit=message_limit(sparse.numel))) as received:
            with record.phase("transfer"):
                first = next(received)  # at once, with the other payloads now in flight
            with record.phase("output"):
                total = output_buffer(out, sparse.numel, sparse.dtype, sparse.device)  # cleared while they travel
            summing = RankOrderSum(total)
            arrivals: Iterator[tuple[int, torch.Tensor]] = chain([first], record.timed(received, "transfer"))
            for rank, buffer in arrivals:
                _add(summing, rank, buffer, own if buffer is payload else None, sparse.shape, record)
        return total


@dataclass(frozen=True)
class FusedCall:
    """One stream's share of a fused exchange: its contribution, request and output buffer."""

    grad: SparseGradient | torch.Tensor
    request: Request
    out: torch.Tensor | None = None


def fused_request(requests: Sequence[Request], check: bool = True) -> Request:
    """What a fused exchange's agreement record is made of: every stream's key and call number in its
    key (so ranks that fuse other streams or calls fail naming them), the first call's number, the
    non-finite flag of any, the first refusal, and the side numbers of the one call that carries some
    (``check``: raise where more than one does; else the first's)."""
    sides = [request.side for request in requests if request.side]
    if check and len(sides) > 1:
        raise SparseCommError("at most one call of a fused exchange may carry side numbers")
    return Request(key="; ".join(f"{request.key} (call {request.call})" for request in requests),
                   call=requests[0].call, nonfinite=any(request.nonfinite for request in requests),
                   refused=next((request.refused for request in requests if request.refused), ""),
                   side=sides[0] if sides else ())


def fused_message(payloads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Payloads (uint8, on the host) as one message: their count and sizes (int64, little-endian),
    then each in turn."""
    header = np.array([len(payloads), *(payload.numel() for payload in payloads)], dtype="<i8")
    return torch.cat([torch.from_numpy(header.view(np.uint8)), *payloads])


def split_message(message: torch.Tensor, numels: Sequence[int]) -> list[torch.Tensor]:
    """A fused message back into its payloads, one per stream of ``numels`` elements (views of
    ``message``). A header that does not describe exactly this message, or announces a payload no
    codec can produce for its stream, raises `PayloadError` before anything is read past it."""
    header_bytes = 8 * (len(numels) + 1)
    if message.numel() < header_bytes:
        raise PayloadError(f"a fused message of {message.numel()} bytes cannot hold the header of {len(numels)} "
                           "payloads")
    header = np.frombuffer(host_bytes(message[:header_bytes]).numpy().tobytes(), dtype="<i8")
    if header[0] != len(numels):
        raise PayloadError(f"a fused message holds {header[0]} payloads where {len(numels)} were agreed")
    sizes = [int(size) for size in header[1:]]
    if any(not 0 < size <= message_limit(numel) for size, numel in zip(sizes, numels, strict=True)):
        raise PayloadError(f"a fused message announces payloads of {sizes} bytes for tensors of {list(numels)} "
                           "elements")
    if header_bytes + sum(sizes) != message.numel():
        raise PayloadError(f"a fused message of {message.numel()} bytes announces {header_bytes + sum(sizes)}")
    ends = np.cumsum([header_bytes, *sizes]).tolist()
    return [message[start:end] for start, end in zip(ends[:-1], ends[1:], strict=True)]


def _refuse(exchange: PayloadExchange | None, group: Group, request: Request, err: BaseException) -> None:
    """This rank could not make its part of a call (``err``, raised by the caller after this): it
    tells its peers with a refusal where its record was due — in the one-round ``exchange``'s first
    round (then waiting for the peers' messages, which land in buffers the session reuses), else in
    the agreement step — so that every rank raises, none left waiting for this rank's payload. A
    request that carries its agreement has none left to take part in."""
    refusal = replace(request, refused=f"{type(err).__name__}: {err}")
    if exchange is not None:
        with closing(exchange):
            exchange.send(agreement_record(refusal, 0, 0), torch.zeros(0, dtype=torch.uint8))
            for _ in exchange.first_round():
                pass
    elif request.agreement is None and world(group)[1] > 1:
        with suppress(SparseCommError):  # raised on every rank: this one raises its own
            agree(group, refusal, 0, 0)


def _session_exchange(session: TransportSession, group: Group) -> PayloadExchange:
    """A one-round exchange on the session's reused receive buffers, its first receives posted."""
    return PayloadExchange(session.payload_capacity, group, (session.receiver("payloads, first round"),
                                                              session.receiver("payloads, second round")),
                           session.one_way_group(group))


def _add(summing: RankOrderSum, rank: int, buffer: torch.Tensor, decoded: SparseGradient | None,
         shape: torch.Size, record: CallRecord) -> None:
    with record.phase("decode"):
        part = decoded if decoded is not None else decode(buffer, expect=shape, device=summing.total.device)
    with record.phase("sum"):
        summing.add(rank, part)


def _check_sizes(sizes: list[int], numel: int, parts: int = 1) -> None:
    """Refuse announced payload sizes no codec can produce for ``numel`` elements (on every rank),
    in one payload or, fused, in ``parts`` behind their header."""
    limit = message_limit(numel, parts)
    if max(sizes) > limit or min(sizes) <= 0:
        raise SparseCommError(f"a rank announced a payload of {max(sizes)} bytes for a tensor of {numel} elements "
                              f"(at most {limit} is possible)")
