"""Collective building blocks on any torch.distributed backend (gloo's gaps filled in).

Every tensor a collective takes or fills lives on its backend's device (`wire_device`): NCCL's
current CUDA device, the CPU for gloo. The helpers here take buffers from anywhere, send them from
that device and hand back what arrives on it; byte parsers read it with `host_bytes`."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Generator
from contextlib import closing

import torch
import torch.distributed as dist

from sparsecomm.errors import PayloadError
from sparsecomm.transport.waiting import wait_for

Group = dist.ProcessGroup | None
Receiver = Callable[[int, int, torch.device], torch.Tensor]
"""(peer, nbytes, device) → the uint8 buffer that peer's message lands in (`fresh_buffer`, or a
session's reused ones: `TransportSession.receiver`)"""


MAX_MESSAGE_SLACK, MAX_MESSAGE_PER_ELEMENT = 1 << 16, 32
"""no codec or stream needs more than this for an N-element tensor (`message_limit`)"""


def message_limit(numel: int, parts: int = 1) -> int:
    """The most bytes a message of a call on an ``numel``-element tensor may announce, in ``parts``
    payloads behind a header: a larger size is refused before anything is allocated for it."""
    return parts * MAX_MESSAGE_SLACK + MAX_MESSAGE_PER_ELEMENT * numel + (8 * (parts + 1) if parts > 1 else 0)


def bounded(sizes: list[int], limit: int | None) -> list[int]:
    """``sizes`` announced by peers, refused (`PayloadError`) where one exceeds ``limit`` or is negative."""
    if limit is not None and any(not 0 <= size <= limit for size in sizes):
        raise PayloadError(f"a rank announced a message of {max(sizes, key=abs)} bytes (at most {limit} is possible "
                           "for this call)")
    return sizes


def fresh_buffer(peer: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def world(group: Group) -> tuple[int, int]:
    """(rank, world size) in ``group``."""
    return dist.get_rank(group), dist.get_world_size(group)


def cuda_backend(config: str) -> str:
    """The backend a group of backend ``config`` (a name, or a device map such as
    ``"cpu:gloo,cuda:nccl"``, as `dist.get_backend_config` gives it) hands CUDA tensors to; its
    processor's where it names none for CUDA."""
    if ":" not in config:
        return config
    by_device = dict(pair.split(":", 1) for pair in config.split(","))
    return by_device.get("cuda", by_device.get("cpu", config))


def backend_of(group: Group) -> str:
    """``group``'s backend for the tensors a collective takes on the wire device: its CUDA backend
    (one made without a backend named maps CUDA to NCCL where there is a GPU, as torch does)."""
    return cuda_backend(str(dist.get_backend_config(group)))


def wire_device(group: Group) -> torch.device:
    """Where ``group``'s collectives take their tensors: NCCL's current CUDA device where NCCL carries
    the group's CUDA tensors; the CPU for gloo (which takes CUDA tensors too, but would copy them
    itself) and every other backend."""
    if backend_of(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def takes_short_messages(group: Group) -> bool:
    """Whether a point-to-point receive may be posted larger than the message it gets: gloo's may,
    NCCL's counts must match (on the wire device, `wire_device`)."""
    return backend_of(group) == "gloo"


def on_wire(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on the wire ``device``: itself when it is there already, else one copy."""
    return tensor if tensor.device == device else tensor.to(device)


def host_bytes(buffer: torch.Tensor) -> torch.Tensor:
    """A received uint8 buffer on the host, where the byte parsers read it (itself on gloo)."""
    return buffer if buffer.device.type == "cpu" else buffer.cpu()


def fingerprint(*parts: object) -> int:
    """A stable 31-bit hash of a configuration, equal on every rank for equal inputs."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def allgather_bytes(buffer: torch.Tensor, group: Group, counts: list[int] | None = None) -> list[torch.Tensor]:
    """Variable-length allgather of a 1-D uint8 tensor: every rank gets every rank's buffer (its
    own is ``buffer`` itself), in rank order. See `allgather_arrivals`."""
    received = dict(allgather_arrivals(buffer, group, counts))
    return [received[r] for r in range(len(received))]


def allgather_arrivals(buffer: torch.Tensor, group: Group, counts: list[int] | None = None,
                       receiver: Receiver = fresh_buffer, limit: int | None = None,
                       ) -> Generator[tuple[int, torch.Tensor], None, None]:
    """Variable-length allgather that yields (rank, buffer) as each arrives: this rank's own (the
    very tensor passed) at once, while the others are still in flight, so the caller can work on
    each while the rest travel. gloo has no allgatherv, so sizes go first (unless ``counts`` already
    holds them), then the buffers, point to point (see `Arrivals`); sizes past ``limit`` are refused
    before any buffer is allocated, on every rank alike. Close the iterator (or exhaust it) before
    the next collective."""
    rank, size = world(group)
    device = wire_device(group)
    if size > 1 and counts is None:
        sizes = torch.zeros(size, dtype=torch.int64, device=device)
        wait_for(all_gather_single(sizes, torch.tensor([buffer.numel()], dtype=torch.int64, device=device), group=group,
                                   async_op=True), device)
        counts = sizes.tolist()
    received = {r: receiver(r, n, device) for r, n in enumerate(bounded(counts or [], limit)) if r != rank}
    sent = on_wire(buffer, device)
    with closing(Arrivals(received, sends={r: sent for r in range(size) if r != rank}, group=group)) as peers:
        yield rank, buffer
        for peer in peers:
            yield peer, received[peer]


def alltoall_bytes(chunks: list[torch.Tensor], group: Group, receiver: Receiver = fresh_buffer,
                   limit: int | None = None) -> list[torch.Tensor]:
    """Uneven all-to-all: ``chunks[r]`` goes to rank r; returns what each rank sent here (sizes past
    ``limit`` refused before anything is allocated for them)."""
    rank, size = world(group)
    device = wire_device(group)
    chunks = [on_wire(c, device) for c in chunks]
    send_counts = torch.tensor([c.numel() for c in chunks], dtype=torch.int64, device=device)
    recv_counts = torch.empty(size, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    received = [chunks[r] if r == rank else receiver(r, n, device)
                for r, n in enumerate(bounded(recv_counts.tolist(), limit))]
    transfer(receives={r: t for r, t in enumerate(received) if r != rank},
             sends={r: c for r, c in enumerate(chunks) if r != rank}, group=group)
    return received


def transfer(receives: dict[int, torch.Tensor], sends: dict[int, torch.Tensor], group: Group,
             one_way: dist.ProcessGroup | None = None) -> None:
    """Point-to-point transfers with peers, all in flight at once; returns when all are done (see
    `Arrivals`)."""
    with closing(Arrivals(receives, sends, group, one_way)) as arrivals:
        for _ in arrivals:
            pass


class Arrivals:
    """Point-to-point transfers with peers (keyed by rank in ``group``; empty tensors skipped, as
    their peers skip them too), started at construction, all in flight at once, every receive posted
    before any send. Iterating yields each receiving peer once its tensor has arrived; `close`
    waits for every transfer still in flight (call it, or exhaust the iterator, before the next
    collective).

    On gloo the order decides whether the two directions of a link overlap: with sends posted
    first a swap can run one direction after the other. Receives start with the next rank down and
    sends with the next rank up, so that no rank is everyone's first.

    ``one_way``: a second group over the same ranks (`TransportSession.one_way_group`). Messages to
    a lower rank then travel on it, so each gloo pair carries one direction only: gloo runs both
    directions of a pair under one lock, and a send waits while the peer's message streams in."""

    def __init__(self, receives: dict[int, torch.Tensor], sends: dict[int, torch.Tensor], group: Group,
                 one_way: dist.ProcessGroup | None = None) -> None:
        self._rank, size = world(group)
        self._group, self._one_way = group, one_way
        self._receiving = sorted(receives, key=lambda peer: (self._rank - peer) % size)
        posted = [peer for peer in self._receiving if receives[peer].numel()]
        works = self._post([(dist.irecv, receives[peer], peer) for peer in posted] + self._send_ops(sends))
        self._receive_works = dict(zip(posted, works[:len(posted)], strict=True))
        self._send_works = works[len(posted):]
        self._next_peer = 0

    def send(self, sends: dict[int, torch.Tensor]) -> None:
        """Post more sends, after the receives: receives posted first, while this rank still
        prepares what it sends, let a peer's message start as soon as the peer sends it (gloo
        holds a send back until its receiver has posted the receive)."""
        self._send_works += self._post(self._send_ops(sends))

    def _send_ops(self, sends: dict[int, torch.Tensor]) -> list[tuple[Callable, torch.Tensor, int]]:
        size = world(self._group)[1]
        ordered = sorted(sends.items(), key=lambda item: (item[0] - self._rank) % size)
        return [(dist.isend, tensor, peer) for peer, tensor in ordered if tensor.numel()]

    def _post(self, ops: list[tuple[Callable, torch.Tensor, int]]) -> list[dist.Work]:
        """Start ``ops`` (function, tensor, peer) in order, each on the group its direction takes,
        those in a row on one group as one batch (all of them, without ``one_way``: NCCL needs a
        rank's receives and sends in one group call); their works, in order."""
        works: list[dist.Work] = []
        batch: list[dist.P2POp] = []
        batch_link = self._group
        for function, tensor, peer in ops:
            sender, receiver = (peer, self._rank) if function is dist.irecv else (self._rank, peer)
            link = self._one_way if self._one_way is not None and sender > receiver else self._group
            if batch and link is not batch_link:
                works += _start(batch)
                batch = []
            batch.append(dist.P2POp(function, tensor, _global(peer, self._group), link))
            batch_link = link
        return works + (_start(batch) if batch else [])

    def __iter__(self) -> Arrivals:
        return self

    def __next__(self) -> int:
        if self._next_peer == len(self._receiving):
            self.close()
            raise StopIteration
        peer = self._receiving[self._next_peer]
        self._next_peer += 1
        if peer in self._receive_works:
            self._receive_works.pop(peer).wait()
        return peer

    def close(self) -> None:
        """Wait for the sends and any receive not yet waited for — every one of them, even after one
        failed (then raising the first failure): a buffer is reused only once nothing writes to it."""
        works = [*self._receive_works.values(), *self._send_works]
        self._receive_works.clear()
        self._send_works.clear()
        failure: BaseException | None = None
        for work in works:
            try:
                work.wait()
            except BaseException as err:  # noqa: BLE001 - raised once every transfer has ended
                failure = failure or err
        if failure is not None:
            raise failure


def _start(batch: list[dist.P2POp]) -> list[dist.Work]:
    """Post ``batch``; a work per operation (a backend that coalesces a batch, as NCCL does, hands
    back one work for all of them)."""
    works = dist.batch_isend_irecv(batch)
    return works if len(works) == len(batch) else [works[-1]] * len(batch)


def exchange_bytes(buffer: torch.Tensor, peer: int, group: Group, limit: int | None = None) -> torch.Tensor:
    """Swap a uint8 buffer with one peer (sizes first, then data; a size past ``limit`` refused)."""
    device = wire_device(group)
    my_size = torch.tensor([buffer.numel()], dtype=torch.int64, device=device)
    peer_size = torch.empty(1, dtype=torch.int64, device=device)
    _sendrecv(my_size, peer_size, peer, group)
    received = torch.empty(bounded([int(peer_size)], limit)[0], dtype=torch.uint8, device=device)
    _sendrecv(on_wire(buffer, device), received, peer, group)
    return received


def send_bytes(buffer: torch.Tensor, peer: int, group: Group) -> None:
    device = wire_device(group)
    dist.send(torch.tensor([buffer.numel()], dtype=torch.int64, device=device), _global(peer, group), group=group)
    if buffer.numel():
        dist.send(on_wire(buffer, device), _global(peer, group), group=group)


def recv_bytes(peer: int, group: Group, limit: int | None = None) -> torch.Tensor:
    """A uint8 buffer from one peer (its size first; a size past ``limit`` refused)."""
    device = wire_device(group)
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, _global(peer, group), group=group)
    buffer = torch.empty(bounded([int(size)], limit)[0], dtype=torch.uint8, device=device)
    if buffer.numel():
        dist.recv(buffer, _global(peer, group), group=group)
    return buffer


def all_reduce_or(bitmap: torch.Tensor, group: Group) -> torch.Tensor:
    """The bitwise OR of a uint8 tensor over the group, in place: gloo's BOR; NCCL has no bitwise
    reductions, so there every rank's bitmap is gathered and folded."""
    if backend_of(group) != "nccl":
        dist.all_reduce(bitmap, op=dist.ReduceOp.BOR, group=group)
        return bitmap
    _, size = world(group)
    gathered = torch.empty(size, bitmap.numel(), dtype=bitmap.dtype, device=bitmap.device)
    all_gather_single(gathered.view(-1), bitmap.contiguous().view(-1), group=group)
    for row in gathered:
        bitmap.view(-1).bitwise_or_(row)
    return bitmap


# torch 2.13 names these all_gather_single and reduce_scatter_single (the older names are deprecated)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _global(peer: int, group: Group) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)


def _sendrecv(send: torch.Tensor, recv: torch.Tensor, peer: int, group: Group) -> None:
    transfer(receives={peer: recv}, sends={peer: send}, group=group)
