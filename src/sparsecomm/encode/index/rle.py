"""``rle``: Deep Gradient Compression's run lengths — for each index, the run of zeros before it as a
little-endian uint16. A run of 65535 or more is written as that many 0xFFFF escape words (each
meaning 65535 zeros and no index yet) followed by the remainder."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsecomm.encode.base import INDEX_CODECS, MAX_STREAM_BYTES, IndexCodec
from sparsecomm.errors import PayloadError, SparseCommError

ESCAPE = 0xFFFF


@INDEX_CODECS.register("rle")
@dataclass(frozen=True)
class RunLengthIndices(IndexCodec):
    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        if indices.size == 0:
            return b""
        runs = np.diff(indices, prepend=-1) - 1
        escapes = runs // ESCAPE
        count = int(escapes.sum()) + indices.size
        if 2 * count > MAX_STREAM_BYTES:  # a run of zeros costs a word per 65,535 of them
            raise SparseCommError(f"rle would take {2 * count} bytes for these {indices.size} indices (at most "
                                  f"{MAX_STREAM_BYTES}): their runs of zeros are too long, use rice")
        words = np.full(count, ESCAPE, dtype="<u2")
        terminators = np.cumsum(escapes + 1) - 1
        words[terminators] = runs % ESCAPE
        return words.tobytes()

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        if len(data) % 2:
            raise PayloadError("rle stream has an odd number of bytes")
        words = np.frombuffer(data, dtype="<u2")
        terminators = np.flatnonzero(words != ESCAPE)
        if terminators.size != nnz:
            raise PayloadError(f"rle stream holds {terminators.size} indices, header says {nnz}")
        if nnz and terminators[-1] != words.size - 1:
            raise PayloadError("rle stream ends with escape words")
        escapes_before = np.diff(terminators, prepend=-1) - 1
        runs = escapes_before * ESCAPE + words[terminators].astype(np.int64)
        return np.cumsum(runs + 1) - 1

    def max_count(self, nbytes: int, numel: int) -> int:
        return nbytes // 2
