"""``huffman``: gaps between sorted indices as (bit-length class, mantissa), the class Huffman-coded.

A gap g ≥ 0 has class s = bit_length(g) (0 for g = 0) and, for s ≥ 2, the s-1 bits below its
leading one as mantissa. Layout: class count n (1 byte), n code lengths (1 byte each), Huffman
stream length (4 bytes LE), Huffman stream, mantissa stream.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from sparsecomm.encode.base import INDEX_CODECS, IndexCodec
from sparsecomm.encode.bits import pack_varwidth, unpack_varwidth
from sparsecomm.encode.huffman_code import HuffmanCode
from sparsecomm.errors import PayloadError

_LEN = struct.Struct("<I")
MAX_CLASS = 64


def bit_length(values: np.ndarray) -> np.ndarray:
    """Bits needed for each non-negative int64 (0 for 0)."""
    out = np.zeros(values.shape, dtype=np.int64)
    positive = values > 0
    out[positive] = np.floor(np.log2(values[positive].astype(np.float64))).astype(np.int64) + 1
    # float rounding near powers of two: fix by one step either way
    out[positive] -= (np.left_shift(1, out[positive] - 1) > values[positive]).astype(np.int64)
    out[positive] += (np.left_shift(1, out[positive]) <= values[positive]).astype(np.int64)
    return out


@INDEX_CODECS.register("huffman")
@dataclass(frozen=True)
class HuffmanIndices(IndexCodec):
    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        gaps = (np.diff(indices, prepend=-1) - 1).astype(np.int64)
        classes = bit_length(gaps)
        n_classes = int(classes.max()) + 1 if gaps.size else 0
        code = HuffmanCode.from_frequencies(np.bincount(classes, minlength=n_classes))
        stream, _ = code.encode(classes)
        mantissa_bits = np.maximum(classes - 1, 0)
        mantissas = gaps - np.where(classes > 0, np.left_shift(1, mantissa_bits), 0)
        mantissa, _ = pack_varwidth(mantissas.astype(np.uint64), mantissa_bits)
        header = bytes([n_classes]) + code.lengths.astype(np.uint8).tobytes() + _LEN.pack(len(stream))
        return header + stream + mantissa

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        if len(data) < 1 or len(data) < 1 + data[0] + _LEN.size:
            raise PayloadError("huffman index stream shorter than its header")
        n_classes = data[0]
        if n_classes > MAX_CLASS:
            raise PayloadError(f"huffman index stream has {n_classes} classes (max {MAX_CLASS})")
        code = HuffmanCode.from_lengths(np.frombuffer(data[1 : 1 + n_classes], dtype=np.uint8))
        offset = 1 + n_classes
        (stream_len,) = _LEN.unpack_from(data, offset)
        offset += _LEN.size
        if offset + stream_len > len(data):
            raise PayloadError("huffman index stream length out of range")
        classes, used = code.decode(data[offset : offset + stream_len], nnz)
        if (used + 7) // 8 != stream_len:
            raise PayloadError("huffman index stream has trailing bytes")
        mantissa_bits = np.maximum(classes - 1, 0)
        if nnz and int(classes.max()) > max(1, int(numel).bit_length()):
            raise PayloadError("huffman gap exceeds the tensor size")
        mantissas = unpack_varwidth(data[offset + stream_len :], mantissa_bits).astype(np.int64)
        gaps = np.where(classes > 0, np.left_shift(1, mantissa_bits), 0) + mantissas
        return np.cumsum(gaps + 1) - 1
