"""``raw``: indices as little-endian int32 or int64."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsecomm.encode.base import INDEX_CODECS, IndexCodec
from sparsecomm.errors import PayloadError, SparseCommError


@INDEX_CODECS.register("raw")
@dataclass(frozen=True)
class RawIndices(IndexCodec):
    bits: int = 32

    def __post_init__(self) -> None:
        if self.bits not in (32, 64):
            raise SparseCommError("raw index width must be 32 or 64 bits")

    @property
    def _dtype(self) -> str:
        return "<i4" if self.bits == 32 else "<i8"

    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        if self.bits == 32 and numel > 2**31:
            raise SparseCommError(f"raw(bits=32) cannot address {numel} elements; use raw(bits=64)")
        return indices.astype(self._dtype).tobytes()

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        if len(data) != nnz * self.bits // 8:
            raise PayloadError(f"raw indices: {len(data)} bytes for {nnz} indices of {self.bits} bits")
        return np.frombuffer(data, dtype=self._dtype).astype(np.int64)

    def max_count(self, nbytes: int, numel: int) -> int:
        return nbytes // (self.bits // 8)
