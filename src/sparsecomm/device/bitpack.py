"""Fixed-width bit fields in 32-bit words, packed and unpacked by tensor ops on any device.

Field i of ``width`` bits holds bits ``[i·width, (i+1)·width)`` of the stream, least significant
first; stream bit b is bit ``b % 32`` of word ``b // 32`` (so the words, little-endian, are also
the stream's bytes in order). A fixed number of ops whatever the count: each field's word and
shift are arithmetic on its position, and fields never share a bit, so adding them is OR-ing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from sparsecomm.errors import SparseCommError

MAX_WIDTH = 32
LOW_WORD = (1 << 32) - 1
BYTES_IN_STREAM_ORDER = sys.byteorder == "little"
"""whether the words' bytes in memory are the stream's bytes in order: single bits then move a
byte at a time (`pack_bits`, `unpack_bits`)"""


def width_for(numel: int) -> int:
    """The fewest bits that address every entry of ``numel`` (at least 1)."""
    width = max(1, (numel - 1).bit_length())
    if width > MAX_WIDTH:
        raise SparseCommError(f"packed indices address at most 2**{MAX_WIDTH} entries, not {numel}")
    return width


def words_for(count: int, width: int) -> int:
    """Words that hold ``count`` fields of ``width`` bits."""
    return -(-count * width // 32)


def pack_fields(values: torch.Tensor, width: int, out: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``values`` (int64, each below 2**width) into ``out`` (int32), field i at stream bit
    ``start + i·width``; the rest of ``out`` is zero."""
    places = start + torch.arange(values.numel(), dtype=torch.int64, device=values.device) * width
    return pack_at(values, places, out)


def pack_at(values: torch.Tensor, places: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``values`` (int64, each field at most 32 bits) at stream bits ``places`` (fields never
    overlap) into ``out`` (int32); the rest of ``out`` is zero."""
    return pack_placed(values, Placed.at(places), out)


@dataclass(frozen=True)
class Placed:
    """Fields at fixed stream bits, each as `pack_placed` and `unpack_placed` need it: the word
    it starts in, the next word (where it may spill), its shift in the word and its mask. Fixed
    by the fields' places and widths, so a stream of fixed sizes builds it once."""

    word: torch.Tensor
    next_word: torch.Tensor
    shift: torch.Tensor
    mask: torch.Tensor | None

    @classmethod
    def at(cls, places: torch.Tensor, widths: torch.Tensor | None = None) -> Placed:
        """Fields at stream bits ``places`` (int64), of ``widths`` bits each (None: pack only)."""
        word = places >> 5
        return cls(word, word + 1, places & 31, None if widths is None else (1 << widths) - 1)


def pack_placed(values: torch.Tensor, placed: Placed, out: torch.Tensor) -> torch.Tensor:
    """`pack_at` with the fields' places resolved beforehand."""
    shifted = values.to(torch.int64) << placed.shift  # below 2**63: width + shift <= 63
    words = torch.zeros(out.numel() + 1, dtype=torch.int64, device=values.device)
    words.index_add_(0, placed.word, shifted & LOW_WORD)
    words.index_add_(0, placed.next_word, shifted >> 32)  # the part that spills into the next word
    words = words[:-1]
    return out.copy_(words - ((words >> 31) << 32))  # as int32, bit for bit


def pack_bits(bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A stream of single bits (``bits``: 0 or 1, stream order) into ``out`` (int32); the rest of
    ``out`` is zero. Eight bits make a byte in one pass over ``bits``, where `pack_at` adds every
    field on its own into 64-bit words: a bitmap packs about ten times faster."""
    if not BYTES_IN_STREAM_ORDER:
        return pack_fields(bits.to(torch.int64), 1, out)
    stream = torch.zeros(out.numel() * 32, dtype=torch.uint8, device=bits.device)
    stream[:bits.numel()] = bits
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    out.view(torch.uint8).copy_((stream.view(-1, 8) << shifts).sum(-1, dtype=torch.uint8))
    return out


def unpack_bits(words: torch.Tensor, count: int, start: int = 0) -> torch.Tensor:
    """The ``count`` single bits (uint8, 0 or 1) from stream bit ``start`` of ``words`` (int32; a
    row of bits per row of a 2-D ``words``), a byte at a time."""
    if not BYTES_IN_STREAM_ORDER:
        return unpack_fields(words, 1, count, start).to(torch.uint8)
    first = start // 8
    data = words.contiguous().view(torch.uint8)[..., first:-(-(start + count) // 8)]
    bits = (data.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=words.device)) & 1
    skip = start - 8 * first
    return bits.flatten(-2)[..., skip:skip + count]


def unpack_fields(words: torch.Tensor, width: int, count: int, start: int = 0) -> torch.Tensor:
    """The ``count`` fields (int64) of ``width`` bits from stream bit ``start`` of ``words`` (int32;
    each row of a 2-D ``words`` a stream of its own, giving a row of fields)."""
    if width == 1 and BYTES_IN_STREAM_ORDER:
        return unpack_bits(words, count, start).long()
    places = start + torch.arange(count, dtype=torch.int64, device=words.device) * width
    return unpack_placed(words, Placed.at(places, torch.full_like(places, width)))


def unpack_placed(words: torch.Tensor, placed: Placed) -> torch.Tensor:
    """The fields (int64) at ``placed``'s places of ``words`` (int32; a row of fields per row of a
    2-D ``words``)."""
    assert placed.mask is not None, "fields placed to be packed only"
    wide = torch.nn.functional.pad(words.to(torch.int64) & LOW_WORD, (0, 1))  # a zero word past the end
    joined = (_gathered(wide, placed.next_word) << 32) | _gathered(wide, placed.word)  # the sign bit lands above
    return (joined >> placed.shift) & placed.mask


def _gathered(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``rows[..., positions]``, by the gather that is fastest on a processor (about twice advanced
    indexing's speed)."""
    if rows.dim() == 1:
        return rows.index_select(0, positions)
    return torch.gather(rows, -1, positions.expand(*rows.shape[:-1], -1))
