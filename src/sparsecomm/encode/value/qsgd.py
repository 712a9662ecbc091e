"""``qsgd``: QSGD stochastic quantization (Alistarh et al.), as used by DeepReduce and SparCML.

Values are cut into buckets of ``bucket`` consecutive entries; each bucket sends its L2 norm as
float32 and every value as a signed level in [-s, s], s = 2**(bits-1) - 1, rounded up with
probability equal to the fractional part, so the decoded value norm*level/s is unbiased.
Layout: ceil(n/bucket) float32 norms (LE), then n levels of ``bits`` bits, offset by +s.
DeepReduce's "7-bit QSGD, 127 levels" is ``qsgd(bits=8,bucket=512)`` here.

With error feedback, prefer bits ≥ 4: at bits=2 (one level) a small value is sent as ±(bucket
norm), the quantizer is not contractive, and the residual can grow without bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.encode.base import VALUE_CODECS, ValueCodec
from sparsecomm.encode.bits import nbytes_for_bits, pack_fixed, unpack_fixed
from sparsecomm.errors import PayloadError, SparseCommError


@VALUE_CODECS.register("qsgd")
@dataclass(frozen=True)
class QSGDValues(ValueCodec):
    bits: int = 8
    bucket: int = 512
    lossless = False

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 16:
            raise SparseCommError("qsgd bits must be in 2..16")
        if not 1 <= self.bucket <= 1 << 24:
            raise SparseCommError("qsgd bucket must be in 1..2**24")

    @property
    def levels(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def _buckets(self, n: int) -> int:
        return -(-n // self.bucket)

    def encode(self, values: torch.Tensor, rng: np.random.Generator) -> bytes:
        v = values.detach().to(torch.float32).cpu().numpy()
        n, s = v.size, self.levels
        padded = np.zeros(self._buckets(n) * self.bucket, dtype=np.float32)
        padded[:n] = v
        by_bucket = padded.reshape(-1, self.bucket)
        norms = np.sqrt(np.einsum("ij,ij->i", by_bucket, by_bucket, dtype=np.float64)).astype(np.float32)
        if not np.isfinite(norms).all():
            raise SparseCommError("qsgd: a bucket's norm overflows float32")
        scale = np.divide(s, norms, out=np.zeros_like(norms), where=norms > 0)
        scaled = (np.abs(by_bucket) * scale[:, None]).reshape(-1)[:n]
        floor = np.floor(scaled)
        level = floor + (rng.random(n, dtype=np.float32) < (scaled - floor))
        level = np.minimum(level, s)
        signed = np.where(v < 0, -level, level).astype(np.int64) + s
        return norms.astype("<f4").tobytes() + pack_fixed(signed.astype(np.uint64), self.bits)

    def decode(self, data: memoryview, nnz: int, dtype: torch.dtype) -> torch.Tensor:
        n_buckets, s = self._buckets(nnz), self.levels
        if len(data) != 4 * n_buckets + nbytes_for_bits(nnz * self.bits):
            raise PayloadError(f"qsgd section of {len(data)} bytes does not fit {nnz} values")
        norms = np.frombuffer(data[: 4 * n_buckets], dtype="<f4")
        if not np.isfinite(norms).all() or (norms < 0).any():
            raise PayloadError("qsgd norm is negative or not finite")
        signed = unpack_fixed(data[4 * n_buckets :], self.bits, nnz).astype(np.int64) - s
        if nnz and int(np.abs(signed).max()) > s:
            raise PayloadError("qsgd level out of range")
        per_value_norm = norms[np.arange(nnz) // self.bucket]  # never bucket × buckets entries
        decoded = per_value_norm * (signed.astype(np.float32) / np.float32(s))
        return torch.from_numpy(decoded.astype(np.float32)).to(dtype)

    def max_count(self, nbytes: int) -> int:
        return 8 * nbytes // self.bits
