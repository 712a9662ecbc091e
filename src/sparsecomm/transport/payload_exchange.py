"""The payload allgather in one round: each rank's agreement record travels in front of its payload.

gloo's point-to-point receives need a buffer of the right size before anything arrives, so a
variable-length allgather would take two rounds: the agreement step's all_gather (which carries
the sizes) and then the payloads. Here every rank posts, for each peer, a receive of the session's
``capacity`` bytes — a number every rank holds alike, because it is derived only from sizes every
rank has seen — and sends one message: its agreement record (the *envelope*, `ENVELOPE_BYTES`)
followed by its payload when both fit in the capacity, the envelope alone when they do not. gloo
accepts a message shorter than the receive buffer (and aborts the process on a longer one, which is
why the capacity must be the same everywhere); payloads say how long they are. The receives are
posted before this rank encodes its payload: gloo holds a send back until its receiver has posted
the receive, so the peers' messages can leave while this rank is still encoding.

Once every envelope is in, every rank holds the same table and checks it exactly as the agreement
step does (`check_table`), so ranks that disagree still fail together with the same message. Ranks
whose payload did not fit send it in a second round, whose sizes the envelopes told everyone. The
next capacity leaves room for twice the largest payload just seen and shrinks slowly, so streams of
different sizes that alternate (the buckets of a model) keep fitting.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from sparsecomm.transport.agreement import NBYTES_FIELD, RECORD_FIELDS
from sparsecomm.transport.collectives import Arrivals, Group, Receiver, fresh_buffer, on_wire, wire_device, world

ENVELOPE_BYTES = RECORD_FIELDS * 8
CAPACITY_HEADROOM = 2
CAPACITY_DECAY = 15 / 16


def next_capacity(previous: int, sizes: list[int]) -> int:
    """The capacity for the next call, from the last call's payload sizes (the same on every rank)."""
    return max(ENVELOPE_BYTES + CAPACITY_HEADROOM * max(sizes, default=0), int(previous * CAPACITY_DECAY))


def fits(nbytes: int, capacity: int) -> bool:
    """Whether a payload of ``nbytes`` travels with its envelope in the first round."""
    return ENVELOPE_BYTES + nbytes <= capacity


class PayloadExchange:
    """One variable-length allgather of payloads with their agreement records (see the module).
    Construction posts the first round's receives; `send` this rank's record and payload (as soon
    as they are ready: peers' messages may arrive meanwhile); iterate `first_round`, read `table`,
    check it, then iterate `second_round`. `close` (or ``with closing(...)``) waits for whatever is
    still in flight. ``receivers``: where each round's messages land (a session's reused buffers, say);
    ``one_way``: see `Arrivals`."""

    def __init__(self, capacity: int, group: Group,
                 receivers: tuple[Receiver, Receiver] = (fresh_buffer, fresh_buffer),
                 one_way: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size = world(group)
        self.group = group
        self.capacity = max(capacity, ENVELOPE_BYTES)
        self._second_receiver = receivers[1]
        self._buffers = {peer: receivers[0](peer, self.capacity, wire_device(group))
                         for peer in range(self.size) if peer != self.rank}
        self._one_way = one_way
        self._round = Arrivals(self._buffers, {}, group, one_way)
        self.records: dict[int, torch.Tensor] = {}

    def send(self, envelope: torch.Tensor, payload: torch.Tensor) -> None:
        """This rank's agreement record, and its payload behind it when both fit in the capacity."""
        self.envelope, self.payload = envelope, on_wire(payload, wire_device(self.group))
        self.records[self.rank] = envelope
        record_bytes = on_wire(envelope.view(torch.uint8), self.payload.device)
        message = torch.cat([record_bytes, self.payload]) if fits(payload.numel(), self.capacity) else record_bytes
        self._round.send({peer: message for peer in self._buffers})

    def first_round(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(rank, its record, its payload if it came with the record) for this rank first, at once
        (its own payload is always at hand), then for each peer as its message arrives."""
        yield self.rank, self.envelope, self.payload
        for peer in self._round:
            buffer = self._buffers[peer]
            record = buffer[:ENVELOPE_BYTES].view(torch.int64).to("cpu", copy=True)
            self.records[peer] = record
            nbytes = int(record[NBYTES_FIELD])
            inline = nbytes > 0 and fits(nbytes, self.capacity)
            yield peer, record, buffer[ENVELOPE_BYTES:ENVELOPE_BYTES + nbytes] if inline else None

    @property
    def table(self) -> torch.Tensor:
        """Every rank's record, in rank order (after `first_round`)."""
        return torch.stack([self.records[r] for r in range(self.size)])

    def second_round(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(rank, payload) for each peer whose payload did not fit, as it arrives; this rank's own
        goes to every peer if it did not fit. Sizes come from the table (checked by then)."""
        late = {r: int(self.records[r][NBYTES_FIELD]) for r in range(self.size)
                if not fits(int(self.records[r][NBYTES_FIELD]), self.capacity)}
        if not late:
            return
        receives = {r: self._second_receiver(r, nbytes, self.payload.device)
                    for r, nbytes in late.items() if r != self.rank}
        sends = {peer: self.payload for peer in range(self.size) if peer != self.rank} if self.rank in late else {}
        self._round = Arrivals(receives, sends, self.group, self._one_way)
        for peer in self._round:
            yield peer, receives[peer]

    def close(self) -> None:
        self._round.close()
