"""Sorted indices in a fixed number of bits, packed and unpacked by tensor ops on any device: the
index form of the ``packed`` codec and of the device route.

The positions ``[0, space)`` are cut into blocks of 2**b; the stream holds each block's count
(enough bits for the most it can hold), then each index's offset inside its block in b bits. The
size depends only on ``space`` and the count, which fix b (the smallest stream): a bitmap where
most blocks of one would hold an index (b = 0, one bit per position), plain fixed-width indices
where few are (one block), and at every density within 1.5x of the information bound log2 C(N, k)
(11.0 bits an index at a density of 1%, 14.3 at 0.1%, against the bound's 8.1 and 11.4, which
``rice`` comes within 1.5% of).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from sparsecomm.device.bitpack import (
    Placed,
    pack_bits,
    pack_placed,
    unpack_bits,
    unpack_fields,
    unpack_placed,
    width_for,
    words_for,
)

STATIC_NONZERO_ON_CUDA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 6)
"""torch.nonzero_static runs on CUDA from PyTorch 2.6"""


@lru_cache(maxsize=4096)
def block_bits(space: int, count: int) -> int:
    """The b that makes ``count`` indices into ``space`` positions the fewest bits."""
    return min(range(width_for(space) + 1), key=lambda b: stream_bits(space, count, b))


def stream_bits(space: int, count: int, b: int) -> int:
    blocks = ((space - 1) >> b) + 1
    return blocks * _count_width(count, b) + count * b


def _count_width(count: int, b: int) -> int:
    return width_for(min(1 << b, count) + 1)


def nwords(space: int, count: int, padded: bool = False) -> int:
    """32-bit words that ``count`` indices into ``space`` positions take (``padded``: some of them
    perhaps unused, see `encode`)."""
    bits = stream_bits(space, count, block_bits(space, count))
    return words_for(bits + (_unused_width(count) if padded else 0), 1)


def _unused_width(count: int) -> int:
    return width_for(count + 1)


@dataclass(frozen=True)
class Stream:
    """Where the fields of a stream of ``count`` indices into ``space`` lie (`encode`, `decode`):
    the number of unused slots in the first ``start`` bits where ``padded``, each block's count,
    then each index's offset in its block, in that order (`Placed`; None for a bitmap). Fixed by
    the sizes: a buffer of fixed sizes builds it once and passes it to every call."""

    space: int
    count: int
    padded: bool
    b: int
    blocks: int
    width: int
    start: int
    placed: Placed | None
    slots: torch.Tensor
    """0, 1, … count - 1"""

    @classmethod
    def of(cls, space: int, count: int, padded: bool, device: torch.device) -> Stream:
        b = block_bits(space, count)
        blocks, width = ((space - 1) >> b) + 1, _count_width(count, b)
        start = _unused_width(count) if padded else 0
        slots = torch.arange(count, dtype=torch.int64, device=device)
        placed = None
        if b:
            head = 1 if padded else 0  # the unused slots' number, at bit 0
            places = torch.cat([torch.zeros(head, dtype=torch.int64, device=device),
                                start + torch.arange(blocks, dtype=torch.int64, device=device) * width,
                                start + blocks * width + slots * b])
            widths = torch.full_like(places, b)
            widths[:head], widths[head:head + blocks] = start, width
            placed = Placed.at(places, widths)
        return cls(space, count, padded, b, blocks, width, start, placed, slots)

    def fits(self, space: int, count: int, padded: bool, device: torch.device) -> bool:
        return (self.space, self.count, self.padded) == (space, count, padded) and self.slots.device == device


def encode(indices: torch.Tensor, space: int, out: torch.Tensor, padded: bool = False,
           stream: Stream | None = None) -> torch.Tensor:
    """``indices`` (int64, ascending, in ``[0, space)``) into ``out`` (int32, `nwords` long). With
    ``padded``, slots holding ``space`` after the others are unused: the stream starts with their
    number, and the blocks count the used ones only (so no block's count outgrows its field).
    ``stream``: the fields' places for these sizes, where the caller keeps them (`Stream.of`)."""
    count = indices.numel()
    if stream is None or not stream.fits(space, count, padded, indices.device):
        stream = Stream.of(space, count, padded, indices.device)
    b, blocks = stream.b, stream.blocks
    used = indices < space
    if stream.placed is None:  # a bitmap
        return pack_bits(_bitmap_stream(indices, space, stream.start, count - used.sum()), out)
    counts = torch.zeros(blocks, dtype=torch.int64, device=indices.device)
    counts.scatter_add_(0, (indices >> b).clamp_(max=blocks - 1), used.long())
    fields = [counts, indices & ((1 << b) - 1)]
    if padded:
        fields.insert(0, (count - used.sum()).view(1))
    return pack_placed(torch.cat(fields), stream.placed, out)


def _bitmap_stream(indices: torch.Tensor, space: int, start: int, unused: torch.Tensor) -> torch.Tensor:
    """The bits of a bitmap's stream: the number of unused slots in ``start`` bits (none without
    padding), then one bit per position, set where an index names it."""
    marks = torch.zeros(space + 1, dtype=torch.uint8, device=indices.device)  # the last: unused slots'
    marks.index_fill_(0, indices, 1)
    head = (unused >> torch.arange(start, device=indices.device)) & 1
    return torch.cat([head.to(torch.uint8), marks[:space]])


def decode(words: torch.Tensor, space: int, count: int, padded: bool = False,
           stream: Stream | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` indices (int64, ascending where the stream is sound; ``space`` in unused slots
    where ``padded``) that ``words`` hold, and a bool: whether the blocks' counts add up to the
    used slots (else the indices are garbage, though below ``space`` rounded up to a whole block).
    A 2-D ``words`` holds a stream per row, and gives a row of indices and a bool per row.
    ``stream``: as for `encode`."""
    if stream is None or not stream.fits(space, count, padded, words.device):
        stream = Stream.of(space, count, padded, words.device)
    b, blocks, start = stream.b, stream.blocks, stream.start
    if stream.placed is None:  # a bitmap
        used = count - unpack_fields(words, start, 1)[..., 0] if padded \
            else torch.tensor(count, device=words.device)
        return _bitmap_positions(unpack_bits(words, blocks, start).bool(), count, used, padded)
    fields = unpack_placed(words, stream.placed)
    if padded:
        used, fields = count - fields[..., 0], fields[..., 1:]
    else:
        used = torch.tensor(count, device=words.device)
    counts, offsets = fields[..., :blocks], fields[..., blocks:]
    ends = counts.cumsum(-1)
    sound = ends[..., -1] == used
    # slot j's block: how many blocks end at or before it (a histogram of the ends, summed up)
    block = torch.zeros(*ends.shape[:-1], count + 1, dtype=torch.int64, device=words.device)
    block = block.scatter_add_(-1, ends.clamp(max=count), torch.ones_like(ends)).cumsum(-1)[..., :count]
    indices = (block.clamp_(max=blocks - 1) << b) | offsets
    if padded:
        indices = torch.where(stream.slots < used[..., None], indices, space)
    return indices, sound


def _bitmap_positions(bits: torch.Tensor, count: int, used: torch.Tensor,
                      padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first ``count`` set positions of ``bits`` (the unused slots, where ``padded``:
    ``space``), and whether the row holds ``used`` of them. One compaction over all rows: each row
    is followed by as many set bits as its unused slots, so a sound row gives ``count`` positions."""
    space = bits.shape[-1]
    sound = bits.sum(-1) == used
    rows = bits.shape[:-1]
    if padded:
        unused = torch.arange(count, device=bits.device) < (count - used)[..., None]
        bits = torch.cat([bits, unused.expand(*rows, count)], -1)
    flat = compact(bits.reshape(-1), math.prod(rows) * count, fill=0).view(*rows, count)
    return (flat % bits.shape[-1]).clamp_(max=space), sound  # each row's positions, from its own start


def compact(mask: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """The positions of the first ``size`` true entries of ``mask``, padded with ``fill``: a fixed
    size, with no host read."""
    if mask.device.type != "cuda" or STATIC_NONZERO_ON_CUDA:
        return torch.nonzero_static(mask, size=size, fill_value=fill).view(-1)
    place = mask.cumsum(0)  # the 1-based place of each true entry
    target = torch.where(mask & (place <= size), place - 1, size)
    out = torch.full((size + 1,), fill, dtype=torch.int64, device=mask.device)
    return out.scatter_(0, target, torch.arange(mask.numel(), device=mask.device))[:size]
