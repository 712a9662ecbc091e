"""``packed``: sorted indices in a size fixed by their count and the tensor's size — each block of
2**b positions' count, then each index's offset in its block in b bits, b chosen for the fewest
bits (`sparsecomm.device.indices`): a bitmap at high density, plain fixed-width indices at the
lowest, and at every density within 1.5x of the information bound, which ``rice`` nearly reaches.

Its size depends only on the count and the tensor's size, so it has a device form in fixed-size
tensor ops: the index codec of the device route, where a GPU packs a bucket's selection without a
host read. ``rice`` takes fewer bytes where the host codes them.
Layout: ``ceil(bits/8)`` bytes of the stream (least significant bit first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.device import indices as packed_indices
from sparsecomm.device.bitpack import MAX_WIDTH
from sparsecomm.encode.base import INDEX_CODECS, IndexCodec
from sparsecomm.encode.bits import nbytes_for_bits
from sparsecomm.errors import PayloadError

MAX_NUMEL = 1 << MAX_WIDTH


@INDEX_CODECS.register("packed")
@dataclass(frozen=True)
class PackedIndices(IndexCodec):
    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        space = max(numel, 1)
        words = torch.empty(packed_indices.nwords(space, indices.size), dtype=torch.int32)
        packed_indices.encode(torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)), space, words)
        return words.numpy().astype("<i4", copy=False).tobytes()[:_nbytes(numel, indices.size)]

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        if numel > MAX_NUMEL:
            raise PayloadError(f"packed indices cannot address a tensor of {numel} entries")
        if len(data) != _nbytes(numel, nnz):
            raise PayloadError(f"packed indices: {len(data)} bytes for {nnz} indices of a tensor of {numel}")
        space = max(numel, 1)
        stream = np.zeros(4 * packed_indices.nwords(space, nnz), dtype=np.uint8)
        stream[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        words = torch.from_numpy(stream.view("<i4").astype(np.int32, copy=False))
        indices, sound = packed_indices.decode(words, space, nnz)
        if not bool(sound):
            raise PayloadError(f"packed indices: the blocks' counts do not add up to {nnz}")
        return indices.numpy()

    def max_count(self, nbytes: int, numel: int) -> int:
        return min(numel, 8 * nbytes)  # every index takes at least a bit


def _nbytes(numel: int, count: int) -> int:
    space = max(numel, 1)
    return nbytes_for_bits(packed_indices.stream_bits(space, count, packed_indices.block_bits(space, count)))
