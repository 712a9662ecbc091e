"""Seeded 64-bit mixing of flat indices (the splitmix64 finaliser), shared by the hashed codecs.

Every rank that uses the same seed gets the same hashes; nothing here touches a global RNG.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
LOW32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)


def mix64(indices: np.ndarray, seed: int | np.uint64) -> np.ndarray:
    """A well-mixed uint64 per index, different for every seed."""
    z = indices.astype(np.uint64) * _GOLDEN + np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def bucket(hashed: np.ndarray, buckets: int | np.ndarray) -> np.ndarray:
    """The high 32 bits of ``hashed`` mapped onto ``[0, buckets)`` by a multiply-shift."""
    return ((hashed >> SHIFT32) * np.asarray(buckets, dtype=np.uint64)) >> SHIFT32
