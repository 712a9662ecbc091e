"""A Bloom filter over flat tensor indices, with hashes computed on the fly.

Sizing follows DeepReduce (App. Remark 2): for ``r`` inserted indices and a target false-positive
rate ε, ``m = ceil(-r ln ε / (ln 2)^2)`` bits and ``h = round((m / r) ln 2)`` hash functions.

Hashing: each index is mixed with the filter's 64-bit seed (`sparsecomm.encode.hashing`); the low and
high 32 bits give h1 and h2, and hash i is ``(h1 + i*h2) mod 2^32`` mapped onto ``[0, m)`` by a
multiply-shift (Kirsch–Mitzenmacher double hashing). Nothing is precomputed per index, so querying
the whole universe costs O(numel) time and O(chunk) memory: indices are tested a chunk at a time,
and hash i is computed only for the indices that passed hashes 0..i-1 (about half survive each).
"""

from __future__ import annotations

import math

import numpy as np

from sparsecomm.encode.hashing import LOW32, SHIFT32, mix64
from sparsecomm.errors import SparseCommError

MAX_BITS = 1 << 32
QUERY_CHUNK = 1 << 16


def filter_size(count: int, fpr: float) -> tuple[int, int]:
    """(bits m, hash functions h) for ``count`` entries at false-positive rate ``fpr``."""
    if not 0.0 < fpr < 1.0:
        raise SparseCommError(f"bloom fpr must be in (0, 1), got {fpr}")
    count = max(count, 1)
    bits = max(8, math.ceil(-count * math.log(fpr) / math.log(2) ** 2))
    if bits > MAX_BITS:
        raise SparseCommError(f"a bloom filter of {bits} bits is too large (max 2**32); "
                              "raise fpr or send fewer entries")
    hashes = max(1, round(bits / count * math.log(2)))
    return bits, hashes


def expected_fpr(count: int, bits: int, hashes: int) -> float:
    """The false-positive rate (1 - e^(-h r / m))^h of a filter holding ``count`` entries."""
    return float((1.0 - math.exp(-hashes * count / bits)) ** hashes)


class BloomFilter:
    """``bits`` (bool array of length m) queried with ``hashes`` double hashes seeded by ``seed``."""

    def __init__(self, bits: np.ndarray, hashes: int, seed: int) -> None:
        self.bits = bits
        self.hashes = hashes
        self.seed = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)

    @property
    def size(self) -> int:
        return int(self.bits.size)

    @classmethod
    def build(cls, indices: np.ndarray, size: int, hashes: int, seed: int) -> BloomFilter:
        """A filter of ``size`` bits holding ``indices``."""
        bloom = cls(np.zeros(size, dtype=bool), hashes, seed)
        bloom.bits[bloom.positions(indices).reshape(-1)] = True
        return bloom

    def _halves(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        z = mix64(indices, self.seed)
        return z & LOW32, (z >> SHIFT32) | np.uint64(1)

    def _position(self, low: np.ndarray, high: np.ndarray, i: int) -> np.ndarray:
        hashed = (low + np.uint64(i) * high) & LOW32
        return (hashed * np.uint64(self.size)) >> SHIFT32

    def positions(self, indices: np.ndarray) -> np.ndarray:
        """The filter bit each hash of each index hits: shape (len(indices), hashes)."""
        low, high = self._halves(indices)
        out = np.empty((indices.size, self.hashes), dtype=np.int64)
        for i in range(self.hashes):
            out[:, i] = self._position(low, high, i)
        return out

    def query(self, numel: int, limit: int, first: int | None = None) -> np.ndarray:
        """Every index in ``[0, numel)`` the filter contains, ascending (true and false positives),
        or only the ``first`` ones. Raises `OverflowError` once more than ``limit`` are found."""
        found: list[np.ndarray] = []
        total = 0
        for start in range(0, numel, QUERY_CHUNK):
            candidates = np.arange(start, min(start + QUERY_CHUNK, numel), dtype=np.int64)
            low, high = self._halves(candidates)
            for i in range(self.hashes):  # integer gathers: far cheaper than boolean masks here
                survivors = np.flatnonzero(self.bits[self._position(low, high, i)])
                candidates = candidates[survivors]
                if not candidates.size or i == self.hashes - 1:
                    break
                low, high = low[survivors], high[survivors]
            total += candidates.size
            found.append(candidates)
            if first is not None and total >= first:  # enough: what lies beyond is never read
                return np.concatenate(found)[:first]
            if total > limit:
                raise OverflowError(f"the filter holds more than {limit} of the tensor's indices")
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
