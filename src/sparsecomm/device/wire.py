"""One fixed-size int32 buffer per bucket and rank: two header words (the bucket layout's digest
stamped with the call's step, `stamped`; and the share of the density its sender proposes for the
next step as float32 bits, 0 where none), the capacity's indices (32-bit words, or
`sparsecomm.device.indices`' fixed-size stream; ``numel``, the padding, for an unused slot), then
their values followed by those of the entries sent whole, which go without indices (every rank's
layout names them), all in the value codec's device form. Every rank's
buffer is the same size, so one equal-size all_gather carries them; the receiver sums them on the
device, rank by rank (each rank's indices are distinct, so every sum is made in the same order
everywhere)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sparsecomm.device import indices as packed_indices
from sparsecomm.device import values as device_values
from sparsecomm.encode.base import ValueCodec
from sparsecomm.host_memory import clear_

HEADER = 2
"""words before the indices: the layout's digest stamped with the step, the proposed share"""


def stamped(digest: int, step: int) -> int:
    """The first header word: the layout's digest mixed with the call's step (31 bits; distinct for
    steps less than 2**31 apart), so a rank at another step reads as one of another layout."""
    return (digest + step * 0x9E3779B1) & 0x7FFFFFFF


class Received(NamedTuple):
    """The ranks' buffers summed (`WireFormat.unpack_sum`), and what the receiver checks."""

    total: torch.Tensor
    agreed: torch.Tensor
    """every rank's header matched the layout and its indices were sound (a 0-d bool)"""
    finite: torch.Tensor
    """the values received were finite, so no entry of the sum overflowed (a 0-d bool)"""
    share: torch.Tensor | None
    """the largest share any rank proposed (a 0-d float32; 0 where none did; None: not asked)"""


@dataclass(frozen=True)
class WireFormat:
    """The buffer of a bucket of ``numel`` entries: ``capacity`` selected entries, ``whole`` sent whole."""

    numel: int
    capacity: int
    whole: int
    values: ValueCodec
    packed: bool = False
    """indices as `sparsecomm.device.indices` packs them, else one 32-bit word each"""
    streams: dict[torch.device, packed_indices.Stream] = field(default_factory=dict, compare=False, repr=False)
    """the packed indices' fields, placed once per device (`stream`)"""

    def stream(self, device: torch.device) -> packed_indices.Stream | None:
        """Where the packed indices' fields lie in a buffer on ``device`` (None: not packed)."""
        if not self.packed:
            return None
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = packed_indices.Stream.of(self.numel, self.capacity, True, device)
        return stream

    @property
    def index_words(self) -> int:
        if self.packed:
            return packed_indices.nwords(self.numel, self.capacity, padded=True)
        return self.capacity

    @property
    def value_words(self) -> int:
        return device_values.nwords(self.values, self.capacity + self.whole)

    @property
    def words(self) -> int:
        return HEADER + self.index_words + self.value_words

    @property
    def whole_bytes(self) -> int:
        """What the entries sent whole add to the buffer."""
        return 4 * (self.value_words - device_values.nwords(self.values, self.capacity))

    def pack(self, out: torch.Tensor, digest: int, indices: torch.Tensor, values: torch.Tensor,
             share: torch.Tensor | float | None = None) -> torch.Tensor:
        """Write the buffer into ``out`` (int32, `words` long): ``values`` holds the selected entries'
        values, then the whole entries'; ``share`` (0-d, or a number), what this rank proposes.
        Returns the values as every receiver decodes them."""
        if isinstance(share, torch.Tensor):
            out[0] = digest
            out[1:2].copy_(share.reshape(1).to(torch.float32).view(torch.int32))
        else:  # both words in one write
            bits = struct.unpack("<I", struct.pack("<f", share or 0.0))[0]
            out[:HEADER].view(torch.int64).fill_(struct.unpack("=q", struct.pack("=iI", digest, bits))[0])
        index_end = HEADER + self.index_words
        if self.packed:
            packed_indices.encode(indices, self.numel, out[HEADER:index_end], padded=True,
                                  stream=self.stream(indices.device))
        else:
            out[HEADER:index_end].copy_(indices)
        return device_values.encode(self.values, values, out[index_end:])

    def unpack_sum(self, gathered: torch.Tensor, world_size: int, digest: int, whole: torch.Tensor | None,
                   device: torch.device,
                   out: torch.Tensor | None = None, shares: bool = False) -> Received:
        """The ranks' buffers (``gathered``, world_size of them end to end) summed into a dense fp32
        tensor of ``numel`` on ``device``, with whether every rank's header matched ``digest`` and
        its indices were sound (in range, its unused slots zero; they are clamped into range, so a
        stranger's buffer is refused by the flag, never written out of bounds), whether the sum is
        finite — checked on the values received, not the sum: their magnitudes' total bounds every
        entry's, so where it is finite no entry of the sum overflowed — and, asked for ``shares``,
        the largest proposed share. The caller raises on the flags. The sum lands in ``out`` (fp32,
        ``numel``) where one is given; an unused slot adds its zero to the last entry."""
        rows = gathered.to(device).view(world_size, self.words)
        agreed = (rows[:, 0] == digest).all()
        share = rows[:, 1].view(torch.float32).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax() if shares else None
        index_end = HEADER + self.index_words
        values = device_values.decode(self.values, rows[:, index_end:], self.capacity + self.whole)
        finite = torch.isfinite(torch.linalg.vector_norm(values, 1))
        values, whole_values = values[:, :self.capacity], values[:, self.capacity:]
        total = clear_(out) if out is not None else torch.zeros(self.numel, dtype=torch.float32, device=device)
        if self.packed:
            indices, sound = packed_indices.decode(rows[:, HEADER:index_end], self.numel, self.capacity, padded=True,
                                                  stream=self.stream(rows.device))
            agreed = agreed & sound.all()
        else:
            indices = rows[:, HEADER:index_end].long()
            agreed = agreed & ((indices >= 0) & (indices <= self.numel)).all()
        # an unused slot (at numel) carries zero (NaN under a non-finite gradient, which the sum's check
        # reports): a value there is a stranger's buffer, not the last entry's
        agreed = agreed & ~((indices >= self.numel) & (values.abs() > 0)).any()
        indices = indices.clamp_(0, max(self.numel - 1, 0))
        for rank in range(world_size):
            total.index_add_(0, indices[rank], values[rank])
            if whole is not None:
                total.index_add_(0, whole, whole_values[rank])
        return Received(total, agreed, finite, share)
