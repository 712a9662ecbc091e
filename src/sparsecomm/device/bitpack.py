"""Fixed-width bit fields in 32-bit words, packed and unpacked by tensor ops on any device.

Field i of ``width`` bits holds bits ``[i·width, (i+1)·width)`` of the stream, least significant
first; stream bit b is bit ``b % 32`` of word ``b // 32`` (so the words, little-endian, are also
the stream's bytes in order). A fixed number of ops whatever the count: each field's word and
shift are arithmetic on its position, and fields never share a bit, so adding them is OR-ing.
"""

from __future__ import annotations

import torch

from sparsecomm.errors import SparseCommError

MAX_WIDTH = 32
LOW_WORD = (1 << 32) - 1


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
    shifted = values.to(torch.int64) << (places & 31)  # below 2**63: width + shift <= 63
    word = places >> 5
    words = torch.zeros(out.numel() + 1, dtype=torch.int64, device=values.device)
    words.index_add_(0, word, shifted & LOW_WORD)
    words.index_add_(0, word + 1, shifted >> 32)  # the part that spills into the next word
    words = words[:-1]
    return out.copy_(words - ((words >> 31) << 32))  # as int32, bit for bit


def unpack_fields(words: torch.Tensor, width: int, count: int, start: int = 0) -> torch.Tensor:
    """The ``count`` fields (int64) of ``width`` bits from stream bit ``start`` of ``words`` (int32;
    each row of a 2-D ``words`` a stream of its own, giving a row of fields)."""
    places = start + torch.arange(count, dtype=torch.int64, device=words.device) * width
    word, shift = places >> 5, places & 31
    wide = torch.nn.functional.pad(words.to(torch.int64) & LOW_WORD, (0, 1))  # a zero word past the end
    joined = (wide[..., word + 1] << 32) | wide[..., word]  # the sign bit only ever lands above the field
    return (joined >> shift) & ((1 << width) - 1)
