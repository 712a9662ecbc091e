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
        v = values.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        n, s = v.numel(), self.levels
        norms = bucket_norms(v, self.bucket)
        divisors = torch.where(norms > 0, norms, torch.ones_like(norms))  # an all-zero bucket's values stay 0
        # level = floor(|v|/norm·s + u), u uniform in [0, 1): rounded up with probability equal to
        # the fractional part; the sign then moves it to [-s, s], stored offset by +s. |v|/norm is at
        # most 1, where s/norm would overflow for a tiny norm
        uniform = torch.from_numpy(rng.random(n, dtype=np.float32))
        levels = torch.empty(n, dtype=torch.uint8 if self.bits <= 8 else torch.int32)
        for start, stop, first in _chunks(n, self.bucket):
            chunk = v[start:stop]
            level = chunk.abs().div_(_per_value(divisors, first, start, stop, self.bucket)).mul_(s)
            level.add_(uniform[start:stop])
            level.floor_().clamp_(max=s).mul_(torch.sign(chunk)).add_(s)
            levels[start:stop] = level
        return norms.numpy().astype("<f4").tobytes() + pack_fixed(levels.numpy(), self.bits)

    def decode(self, data: memoryview, nnz: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """As every value codec's; ``out`` (``nnz`` entries, on any device), when given, receives the
        values instead of a new tensor — a dense phase decodes straight into the result."""
        n_buckets, s = self._buckets(nnz), self.levels
        if len(data) != 4 * n_buckets + nbytes_for_bits(nnz * self.bits):
            raise PayloadError(f"qsgd section of {len(data)} bytes does not fit {nnz} values")
        norms = torch.from_numpy(np.frombuffer(data[: 4 * n_buckets], dtype="<f4").astype(np.float32))
        if not bool(torch.isfinite(norms).all()) or bool((norms < 0).any()):
            raise PayloadError("qsgd norm is negative or not finite")
        levels = unpack_fixed(data[4 * n_buckets :], self.bits, nnz)
        if nnz and int(levels.max()) > 2 * s:
            raise PayloadError("qsgd level out of range")
        step = norms / s  # value of one level in each bucket
        stored = torch.from_numpy(levels.astype(np.int32, copy=False) if levels.dtype == np.uint64 else levels)
        decoded = out if out is not None else torch.empty(nnz, dtype=dtype)
        for start, stop, first in _chunks(nnz, self.bucket):
            level = stored[start:stop].to(torch.float32).sub_(s)
            decoded[start:stop] = level.mul_(_per_value(step, first, start, stop, self.bucket))
        return decoded

    def max_count(self, nbytes: int) -> int:
        return 8 * nbytes // self.bits


CHUNK = 1 << 16
"""values per pass of the quantizer's element-wise steps, so their intermediates stay in cache"""


TINY_NORM = 1e-18
"""below this a float32 norm may have lost its entries' squares to underflow (they fall below
float32's normal range for entries under about 1e-19): such norms are taken in float64"""


def bucket_norms(values: torch.Tensor, bucket: int) -> torch.Tensor:
    """Each bucket's L2 norm as float32 (in float64 where float32's squares overflow or underflow)."""
    n = values.numel()
    padded = values if n % bucket == 0 else torch.cat([values, values.new_zeros(-n % bucket)])
    by_bucket = padded.view(-1, bucket) if n else padded.view(0, bucket)
    norms = torch.linalg.vector_norm(by_bucket, dim=1)
    imprecise = ~torch.isfinite(norms) | (norms < TINY_NORM)
    if bool(imprecise.any()):
        norms[imprecise] = torch.linalg.vector_norm(by_bucket[imprecise].double(), dim=1).float()
        if not bool(torch.isfinite(norms).all()):
            raise SparseCommError("qsgd: a bucket's norm overflows float32")
    return norms


def _chunks(n: int, bucket: int) -> list[tuple[int, int, int]]:
    """(start, stop, first bucket) of each pass; whole buckets per pass where a bucket fits in one."""
    step = (CHUNK // bucket) * bucket if bucket <= CHUNK else CHUNK
    return [(start, min(n, start + step), start // bucket) for start in range(0, n, step)]


def _per_value(per_bucket: torch.Tensor, first: int, start: int, stop: int, bucket: int) -> torch.Tensor:
    """``per_bucket``'s entry for each value in [start, stop) (buckets from ``first`` on)."""
    last = (stop - 1) // bucket + 1
    edges = torch.arange(first, last + 1, dtype=torch.int64).mul_(bucket).clamp_(start, stop)
    return torch.repeat_interleave(per_bucket[first:last], edges.diff())
