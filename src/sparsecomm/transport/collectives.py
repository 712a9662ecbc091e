"""Collective building blocks on any torch.distributed backend (gloo's gaps filled in)."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def world(group: Group) -> tuple[int, int]:
    """(rank, world size) in ``group``."""
    return dist.get_rank(group), dist.get_world_size(group)


def fingerprint(*parts: object) -> int:
    """A stable 31-bit hash of a configuration, equal on every rank for equal inputs."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def allgather_bytes(buffer: torch.Tensor, group: Group, counts: list[int] | None = None) -> list[torch.Tensor]:
    """Variable-length allgather of a 1-D uint8 tensor: every rank gets every rank's buffer (its
    own is ``buffer`` itself). gloo has no allgatherv, so sizes go first (unless ``counts`` already
    holds them), then the buffers, point to point (see `transfer`)."""
    rank, size = world(group)
    if size == 1:
        return [buffer]
    if counts is None:
        sizes = torch.zeros(size, dtype=torch.int64)
        all_gather_single(sizes, torch.tensor([buffer.numel()], dtype=torch.int64), group=group)
        counts = sizes.tolist()
    received = [buffer if r == rank else torch.empty(n, dtype=torch.uint8) for r, n in enumerate(counts)]
    transfer(receives={r: t for r, t in enumerate(received) if r != rank},
             sends={r: buffer for r in range(size) if r != rank}, group=group)
    return received


def alltoall_bytes(chunks: list[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """Uneven all-to-all: ``chunks[r]`` goes to rank r; returns what each rank sent here."""
    rank, size = world(group)
    send_counts = torch.tensor([c.numel() for c in chunks], dtype=torch.int64)
    recv_counts = torch.empty(size, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    received = [chunks[r] if r == rank else torch.empty(n, dtype=torch.uint8)
                for r, n in enumerate(recv_counts.tolist())]
    transfer(receives={r: t for r, t in enumerate(received) if r != rank},
             sends={r: c for r, c in enumerate(chunks) if r != rank}, group=group)
    return received


def transfer(receives: dict[int, torch.Tensor], sends: dict[int, torch.Tensor], group: Group) -> None:
    """Point-to-point transfers with peers (keyed by rank in ``group``; empty tensors skipped, as
    their peers skip them too), all in flight at once, every receive posted before any send.

    On gloo the order decides whether the two directions of a link overlap: with sends posted
    first a swap can run one direction after the other. Sends start with the next rank up, so that
    no rank is everyone's first."""
    rank, size = world(group)
    ops = [dist.P2POp(dist.irecv, tensor, _global(peer, group), group)
           for peer, tensor in sorted(receives.items(), key=lambda item: (rank - item[0]) % size) if tensor.numel()]
    ops += [dist.P2POp(dist.isend, tensor, _global(peer, group), group)
            for peer, tensor in sorted(sends.items(), key=lambda item: (item[0] - rank) % size) if tensor.numel()]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def exchange_bytes(buffer: torch.Tensor, peer: int, group: Group) -> torch.Tensor:
    """Swap a uint8 buffer with one peer (sizes first, then data)."""
    my_size = torch.tensor([buffer.numel()], dtype=torch.int64)
    peer_size = torch.empty(1, dtype=torch.int64)
    _sendrecv(my_size, peer_size, peer, group)
    received = torch.empty(int(peer_size), dtype=torch.uint8)
    _sendrecv(buffer, received, peer, group)
    return received


def send_bytes(buffer: torch.Tensor, peer: int, group: Group) -> None:
    dist.send(torch.tensor([buffer.numel()], dtype=torch.int64), _global(peer, group), group=group)
    if buffer.numel():
        dist.send(buffer, _global(peer, group), group=group)


def recv_bytes(peer: int, group: Group) -> torch.Tensor:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, _global(peer, group), group=group)
    buffer = torch.empty(int(size), dtype=torch.uint8)
    if buffer.numel():
        dist.recv(buffer, _global(peer, group), group=group)
    return buffer


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _global(peer: int, group: Group) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)


def _sendrecv(send: torch.Tensor, recv: torch.Tensor, peer: int, group: Group) -> None:
    transfer(receives={peer: recv}, sends={peer: send}, group=group)
