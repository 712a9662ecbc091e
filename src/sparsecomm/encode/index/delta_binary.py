"""``delta_binary``: SketchML's keys — deltas between sorted indices (the first from -1), each in
1, 2, 4 or 8 little-endian bytes; a 2-bit prefix (0..3 for 1/2/4/8 bytes) per delta, four to a byte.
Layout: prefixes (ceil(nnz/4) bytes), then the delta bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsecomm.encode.base import INDEX_CODECS, IndexCodec
from sparsecomm.encode.bits import pack_fixed, unpack_fixed
from sparsecomm.errors import PayloadError

_SIZES = np.array([1, 2, 4, 8])


@INDEX_CODECS.register("delta_binary")
@dataclass(frozen=True)
class DeltaBinaryIndices(IndexCodec):
    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        deltas = np.diff(indices, prepend=-1).astype(np.uint64)
        prefix = (
            (deltas >= 1 << 8).astype(np.uint64)
            + (deltas >= 1 << 16).astype(np.uint64)
            + (deltas >= 1 << 32).astype(np.uint64)
        )
        sizes = _SIZES[prefix.astype(np.int64)]
        delta_bytes = deltas.astype("<u8").view(np.uint8).reshape(-1, 8)
        body = delta_bytes[np.arange(8) < sizes[:, None]]
        return pack_fixed(prefix, 2) + body.tobytes()

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        head = (2 * nnz + 7) // 8
        if len(data) < head:
            raise PayloadError("delta_binary stream shorter than its prefixes")
        sizes = _SIZES[unpack_fixed(data[:head], 2, nnz).astype(np.int64)]
        body = np.frombuffer(data[head:], dtype=np.uint8)
        if body.size != int(sizes.sum()):
            raise PayloadError(f"delta_binary body has {body.size} bytes, prefixes say {int(sizes.sum())}")
        delta_bytes = np.zeros((nnz, 8), dtype=np.uint8)
        delta_bytes[np.arange(8) < sizes[:, None]] = body
        deltas = delta_bytes.view("<u8").reshape(nnz)
        if nnz and (deltas[1:] == 0).any():
            raise PayloadError("delta_binary holds a zero delta (duplicate index)")
        if nnz and int(deltas.max()) > numel:
            raise PayloadError("delta_binary delta exceeds the tensor size")
        return np.cumsum(deltas.astype(np.int64)) - 1

    def max_count(self, nbytes: int, numel: int) -> int:
        return nbytes  # at least one body byte per delta
