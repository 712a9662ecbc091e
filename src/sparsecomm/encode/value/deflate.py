"""``deflate``: the values' bytes through zlib (DeepReduce's Deflate). Lossless.

With ``shuffle`` (default) the bytes are first grouped by position within each value (all first
bytes, then all second bytes, ...), which lets Deflate find the repetition in exponents and signs.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.encode.base import VALUE_CODECS, ValueCodec
from sparsecomm.encode.value.dtypes import tensor_bytes, tensor_from_bytes
from sparsecomm.errors import PayloadError, SparseCommError

MAX_EXPANSION = 1032  # Deflate's largest possible decompression ratio


def shuffle_bytes(byte_rows: np.ndarray, shuffle: bool) -> bytes:
    return (np.ascontiguousarray(byte_rows.T) if shuffle else byte_rows).tobytes()


def unshuffle_bytes(raw: bytes, count: int, itemsize: int, shuffle: bool) -> np.ndarray:
    rows = np.frombuffer(raw, dtype=np.uint8)
    return rows.reshape(itemsize, count).T.copy() if shuffle else rows


@VALUE_CODECS.register("deflate")
@dataclass(frozen=True)
class DeflateValues(ValueCodec):
    level: int = 6
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.level <= 9:
            raise SparseCommError("deflate level must be in 0..9")

    def encode(self, values: torch.Tensor, rng: np.random.Generator) -> bytes:
        return zlib.compress(shuffle_bytes(tensor_bytes(values), self.shuffle), self.level)

    def decode(self, data: memoryview, nnz: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        expected = nnz * itemsize
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(bytes(data), max(expected, 1))  # 0 would mean unlimited
        except zlib.error as err:
            raise PayloadError(f"deflate stream is corrupt: {err}") from None
        if len(raw) != expected or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
            raise PayloadError(f"deflate stream does not hold exactly {nnz} values")
        return tensor_from_bytes(unshuffle_bytes(raw, nnz, itemsize, self.shuffle), dtype, nnz)

    def max_count(self, nbytes: int) -> int:
        return MAX_EXPANSION * nbytes
