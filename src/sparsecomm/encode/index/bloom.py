"""``bloom``: DeepReduce's lossy Bloom-filter index codec, ``bloom(policy=p2, fpr=0.001)``.

The sender inserts its r indices into a filter sized for false-positive rate ``fpr``; a receiver
tests every index of the tensor against it and keeps the positives the ``policy`` picks (see
`bloom_policies`). The sender runs the same test, so it knows which indices the receiver will
keep and sends their values — from the dense gradient where it has one (false positives then
carry their true values, as in GRACE), else zero.

Layout: seed (u64), filter bits m (u64), hash functions h (u8), then the m bits, LSB first.

Cost: a filter of m ≈ 1.44·log2(1/fpr) bits per index, but decoding tests all ``numel`` indices
(O(numel) time, O(chunk) memory). A filter may pass at most ``POSITIVES_PER_BIT``·m/h + 64
positives, which bounds the receiver's conflict sets (positives × h hashes) to 8 int64 per filter
bit. Where the sender's filter would pass more (a tiny selection of a huge tensor, where false
positives outnumber the selection many times), the section holds the indices exactly instead:
a header of zeros (no filter) followed by ``rice``-coded indices, so encoding never fails.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from sparsecomm.encode.base import INDEX_CODECS, IndexCodec
from sparsecomm.encode.bits import nbytes_for_bits
from sparsecomm.encode.index.bloom_filter import BloomFilter, filter_size
from sparsecomm.encode.index.bloom_policies import POLICIES, choose
from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.errors import PayloadError, SparseCommError

_HEAD = struct.Struct("<QQB")
MAX_HASHES = 32
MIN_FPR = 1e-9
"""the lowest false-positive rate a filter is built for (about 30 hash functions)"""
POSITIVES_PER_BIT = 8
EXACT = (0, 0, 0)
"""(seed, bits, hashes) of a section that holds rice-coded indices instead of a filter"""


def positives_limit(bits: int, hashes: int) -> int:
    """The most positives a filter of ``bits`` bits and ``hashes`` hashes may pass."""
    return POSITIVES_PER_BIT * bits // hashes + 64


@INDEX_CODECS.register("bloom")
@dataclass(frozen=True)
class BloomIndices(IndexCodec):
    policy: str = "p2"
    fpr: float = 0.001
    lossless = False
    scans_numel = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise SparseCommError(f"bloom policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        filter_size(1, self.fpr)  # validates fpr
        if self.fpr < MIN_FPR:
            raise SparseCommError(f"bloom fpr must be at least {MIN_FPR}, got {self.fpr}")

    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        return self.encode_selecting(indices, numel, np.random.default_rng(0))[0]

    def encode_selecting(self, indices: np.ndarray, numel: int,
                         rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
        bits, hashes = filter_size(indices.size, self.fpr)
        seed = int(rng.integers(1 << 63))
        bloom = BloomFilter.build(indices, bits, hashes, seed)
        try:
            kept = self._keep(bloom, numel, indices.size, seed, all_positives=True)
        except OverflowError:  # too many false positives for a receiver to sort out: send them exactly
            return _HEAD.pack(*EXACT) + RiceIndices().encode(indices, numel), indices
        section = _HEAD.pack(seed, bits, hashes) + np.packbits(bloom.bits, bitorder="little").tobytes()
        if self.policy == "naive":  # the receiver keeps the first r positives; we send our own values
            return section, indices
        return section, kept

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        if len(data) < _HEAD.size:
            raise PayloadError(f"bloom section of {len(data)} bytes is shorter than its header")
        seed, bits, hashes = _HEAD.unpack_from(data)
        if (seed, bits, hashes) == EXACT:
            return RiceIndices().decode(data[_HEAD.size:], numel, nnz)
        if not 1 <= hashes <= MAX_HASHES or not 8 <= bits < 1 << 32:
            raise PayloadError(f"bloom header claims {bits} bits and {hashes} hashes")
        if len(data) != _HEAD.size + nbytes_for_bits(bits):
            raise PayloadError(f"bloom filter of {bits} bits needs {nbytes_for_bits(bits)} bytes")
        packed = np.frombuffer(data, dtype=np.uint8, offset=_HEAD.size)
        bloom = BloomFilter(np.unpackbits(packed, count=bits, bitorder="little").view(bool), hashes, seed)
        try:
            kept = self._keep(bloom, numel, nnz, seed)
        except OverflowError as err:
            raise PayloadError(f"bloom filter: {err}") from None
        if kept.size != nnz:
            raise PayloadError(f"bloom filter yields {kept.size} indices, header says {nnz}")
        return kept

    def _keep(self, bloom: BloomFilter, numel: int, count: int, seed: int, all_positives: bool = False) -> np.ndarray:
        """The indices a receiver keeps: ``count`` of the positives (all of them for p0). The sender
        counts all positives even where the policy keeps the first ``count`` (``all_positives``), so
        that every policy falls back to exact indices alike."""
        first = count if self.policy in ("naive", "leftmost") and not all_positives else None
        positives = bloom.query(numel, positives_limit(bloom.size, bloom.hashes), first=first)
        positions = bloom.positions(positives) if self.policy == "p2" else None
        return choose(self.policy, positives, positions, count, np.random.default_rng([seed, 1]))

    def max_count(self, nbytes: int, numel: int) -> int:
        exact = RiceIndices().max_count(max(nbytes - _HEAD.size, 0), numel)
        return min(numel, max(positives_limit(8 * nbytes, 1), exact))
