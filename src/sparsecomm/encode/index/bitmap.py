"""``bitmap``: one bit per element of the tensor, packed MSB first; ``numel/8`` bytes whatever nnz."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsecomm.encode.base import INDEX_CODECS, IndexCodec
from sparsecomm.encode.bits import nbytes_for_bits
from sparsecomm.errors import PayloadError


@INDEX_CODECS.register("bitmap")
@dataclass(frozen=True)
class BitmapIndices(IndexCodec):
    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        mask = np.zeros(numel, dtype=np.uint8)
        mask[indices] = 1
        return np.packbits(mask).tobytes()

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        if len(data) != nbytes_for_bits(numel):
            raise PayloadError(f"bitmap of {numel} bits needs {nbytes_for_bits(numel)} bytes, got {len(data)}")
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        if bits[numel:].any():
            raise PayloadError("bitmap has bits set past the end of the tensor")
        indices = np.flatnonzero(bits)
        if indices.size != nnz:
            raise PayloadError(f"bitmap marks {indices.size} elements, header says {nnz}")
        return indices.astype(np.int64)
