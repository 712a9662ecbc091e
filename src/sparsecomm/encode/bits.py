"""Vectorised bit packing shared by the codecs. Streams are MSB-first (``np.packbits`` order)."""

from __future__ import annotations

import numpy as np

from sparsecomm.errors import PayloadError

_U64 = np.uint64


def nbytes_for_bits(bits: int) -> int:
    return (bits + 7) // 8


def _rows_to_uint(bit_rows: np.ndarray) -> np.ndarray:
    """(count, width) array of 0/1 (width ≤ 64, MSB first) → uint64 per row."""
    count, width = bit_rows.shape
    padded = np.zeros((count, 64), dtype=np.uint8)
    padded[:, 64 - width :] = bit_rows
    return np.packbits(padded, axis=1).view(">u8").reshape(count).astype(_U64)


def _uint_to_rows(values: np.ndarray, width: int) -> np.ndarray:
    """uint64 per value → (count, width) array of its low ``width`` bits, MSB first."""
    nbytes = nbytes_for_bits(width)
    be = values.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - nbytes :]
    return np.unpackbits(be, axis=1)[:, 8 * nbytes - width :]


def pack_fixed(values: np.ndarray, width: int) -> bytes:
    """Each value (< 2**width) as a ``width``-bit field, fields back to back."""
    if width < 0 or width > 64:
        raise ValueError(f"field width {width} outside 0..64")
    if width == 0 or values.size == 0:
        return b""
    if width in (8, 16, 32, 64):
        return values.astype(f">u{width // 8}").tobytes()
    if width < 8:
        return _pack_small(values, width)
    return np.packbits(_uint_to_rows(values.astype(_U64), width).reshape(-1)).tobytes()


_GROUP = 8
"""fields per word in the 1–7-bit paths: 8 fields of w bits are exactly w bytes"""


def _pack_small(values: np.ndarray, width: int) -> bytes:
    """Widths 1–7: each 8 fields are OR-ed into one 64-bit word whose low ``width`` bytes are
    their ``width`` bytes of output — one pass of word arithmetic, no array of bits."""
    count = values.size
    groups = -(-count // _GROUP)
    fields = np.zeros(groups * _GROUP, dtype=np.uint8)
    fields[:count] = values
    columns = fields.reshape(groups, _GROUP).T.astype(_U64)  # column j: field j of every word
    words = columns[0] << _U64(width * (_GROUP - 1))
    for j in range(1, _GROUP):
        words |= columns[j] << _U64(width * (_GROUP - 1 - j))
    out = words.astype(">u8").view(np.uint8).reshape(groups, 8)[:, 8 - width :]
    return out.tobytes()[: nbytes_for_bits(count * width)]


def _unpack_small(data: bytes | memoryview, width: int, count: int) -> np.ndarray:
    """Inverse of `_pack_small`: every ``width`` bytes become one word, split into 8 fields."""
    groups = -(-count // _GROUP)
    padded = np.zeros(groups * width, dtype=np.uint8)
    stream = np.frombuffer(data, dtype=np.uint8)
    padded[: stream.size] = stream
    raw = np.zeros((groups, 8), dtype=np.uint8)
    raw[:, 8 - width :] = padded.reshape(groups, width)
    words = raw.view(">u8").reshape(groups).astype(_U64)
    shifts = (width * np.arange(_GROUP - 1, -1, -1)).astype(_U64)
    fields = (words[:, None] >> shifts) & _U64((1 << width) - 1)
    return fields.reshape(-1)[:count]


def unpack_fixed(data: bytes | memoryview, width: int, count: int) -> np.ndarray:
    """Inverse of `pack_fixed`; ``data`` must hold exactly ``ceil(count*width/8)`` bytes."""
    expected = nbytes_for_bits(count * width)
    if len(data) != expected:
        raise PayloadError(f"{count} fields of {width} bits need {expected} bytes, got {len(data)}")
    if width == 0 or count == 0:
        return np.zeros(count, dtype=_U64)
    if width in (8, 16, 32, 64):
        return np.frombuffer(data, dtype=f">u{width // 8}").astype(_U64)
    if width < 8:
        return _unpack_small(data, width, count)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * width)
    return _rows_to_uint(bits.reshape(count, width))


def pack_unary(quotients: np.ndarray) -> bytes:
    """Each q ≥ 0 as q zero bits then a one bit."""
    if quotients.size == 0:
        return b""
    ends = np.cumsum(quotients.astype(np.int64) + 1) - 1
    nbytes = nbytes_for_bits(int(ends[-1]) + 1)
    weights = np.right_shift(128, ends & 7)
    return np.bincount(ends >> 3, weights=weights, minlength=nbytes).astype(np.uint8).tobytes()


def unpack_unary(data: bytes | memoryview, count: int) -> np.ndarray:
    """Inverse of `pack_unary` for ``count`` values; trailing bits after the last one must be zero."""
    if count == 0:
        if any(data):
            raise PayloadError("unary stream holds bits but no values were expected")
        return np.zeros(0, dtype=np.int64)
    ones = np.flatnonzero(np.unpackbits(np.frombuffer(data, dtype=np.uint8)))
    if ones.size != count:
        raise PayloadError(f"unary stream holds {ones.size} values, expected {count}")
    if nbytes_for_bits(int(ones[-1]) + 1) != len(data):
        raise PayloadError("unary stream has trailing bytes")
    return np.diff(ones, prepend=-1) - 1


def pack_varwidth(values: np.ndarray, lengths: np.ndarray) -> tuple[bytes, int]:
    """Each value as a field of its own length (≤ 64 bits); returns (bytes, total bits)."""
    if values.size == 0:
        return b"", 0
    width = int(lengths.max())
    if width == 0:
        return b"", 0
    aligned = values.astype(_U64) << (width - lengths).astype(_U64)
    rows = _uint_to_rows(aligned, width)
    keep = np.arange(width) < lengths[:, None]
    bits = rows[keep]
    return np.packbits(bits).tobytes(), int(bits.size)


def unpack_varwidth(data: bytes | memoryview, lengths: np.ndarray) -> np.ndarray:
    """Inverse of `pack_varwidth` given every field's length."""
    total = int(lengths.sum())
    if len(data) != nbytes_for_bits(total):
        raise PayloadError(f"fields of {total} bits need {nbytes_for_bits(total)} bytes, got {len(data)}")
    if lengths.size == 0 or total == 0:
        return np.zeros(lengths.size, dtype=_U64)
    width = int(lengths.max())
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=total)
    bits = np.concatenate([bits, np.zeros(width, dtype=np.uint8)])
    starts = np.cumsum(lengths) - lengths
    windows = bits[starts[:, None] + np.arange(width)]
    return _rows_to_uint(windows) >> (width - lengths).astype(_U64)
