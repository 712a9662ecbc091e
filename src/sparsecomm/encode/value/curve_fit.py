"""DeepReduce's curve-fit value compression (§5): what ``polyfit`` and ``dexp`` share.

The values are split into two parts: the positive ones and the magnitudes of the others, each
sorted descending, so each is a smooth decreasing curve. A model of each curve is sent instead of
the values, plus the reordering: for every value, in index order, its rank in the sorted order, in
``ceil(log2 n)`` bits (§5.1). The reordering lives in the value section, so any index codec can go
with a curve-fit value codec. A decoded value keeps its sign (each part is clipped at zero).

Section layout: count of positive values (u32), then per part its model's length (u32) and bytes,
then the ranks (``pack_fixed``). Subclasses implement `fit` and `evaluate` for one part.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from sparsecomm.encode.base import ValueCodec
from sparsecomm.encode.bits import pack_fixed, unpack_fixed
from sparsecomm.errors import PayloadError, SparseCommError

_COUNT = struct.Struct("<I")
MAX_VALUES = (1 << 32) - 1
FLOAT32_SAFE = 1e36  # models hold float32 coefficients: leave headroom below float32's 3.4e38


def rank_bits(count: int) -> int:
    return max(1, math.ceil(math.log2(count))) if count > 1 else 0


class CurveFitValues(ValueCodec):
    lossless = False

    def fit(self, curve: np.ndarray) -> bytes:
        """The model of ``curve`` (float64, descending, non-negative, at least one point)."""
        raise NotImplementedError

    def evaluate(self, model: memoryview, count: int) -> np.ndarray:
        """The ``count`` points (float64) the model describes; `PayloadError` if it is malformed."""
        raise NotImplementedError

    def encode(self, values: torch.Tensor, rng: np.random.Generator) -> bytes:
        v = values.detach().to(torch.float64).cpu().numpy()
        if v.size > MAX_VALUES:
            raise SparseCommError(f"{self.name} codes at most {MAX_VALUES} values")
        if v.size and float(np.abs(v).max()) > FLOAT32_SAFE:
            raise SparseCommError(f"{self.name}: a value overflows its float32 model")
        positive = v > 0
        order = np.concatenate([np.flatnonzero(positive), np.flatnonzero(~positive)])
        magnitude = np.abs(v[order])
        n_positive = int(positive.sum())
        within = np.concatenate([np.argsort(-magnitude[:n_positive], kind="stable"),
                                 n_positive + np.argsort(-magnitude[n_positive:], kind="stable")])
        sorted_order = order[within]  # sorted position -> index position
        curve = magnitude[within]
        parts = [_COUNT.pack(n_positive)]
        for part in (curve[:n_positive], curve[n_positive:]):
            model = self.fit(part) if part.size else b""
            parts += [_COUNT.pack(len(model)), model]
        rank = np.empty(v.size, dtype=np.uint64)
        rank[sorted_order] = np.arange(v.size, dtype=np.uint64)
        parts.append(pack_fixed(rank, rank_bits(v.size)))
        return b"".join(parts)

    def decode(self, data: memoryview, nnz: int, dtype: torch.dtype) -> torch.Tensor:
        offset = 0

        def take(size: int) -> memoryview:
            nonlocal offset
            if offset + size > len(data):
                raise PayloadError(f"{self.name} section is truncated")
            offset += size
            return data[offset - size : offset]

        (n_positive,) = _COUNT.unpack(take(_COUNT.size))
        if n_positive > nnz:
            raise PayloadError(f"{self.name}: {n_positive} positive values of {nnz}")
        curves = []
        for sign, count in ((1.0, n_positive), (-1.0, nnz - n_positive)):
            (length,) = _COUNT.unpack(take(_COUNT.size))
            model = take(length)
            if count == 0:
                if length:
                    raise PayloadError(f"{self.name}: a model for an empty part")
                continue
            points = self.evaluate(model, count)
            if points.shape != (count,) or not np.isfinite(points).all():
                raise PayloadError(f"{self.name}: the model does not give {count} finite values")
            curves.append(sign * np.maximum(points, 0.0))
        rank = unpack_fixed(data[offset:], rank_bits(nnz), nnz).astype(np.int64)
        if nnz and (int(rank.max()) >= nnz or not (np.bincount(rank, minlength=nnz) == 1).all()):
            raise PayloadError(f"{self.name}: the reordering is not a permutation")
        sorted_values = np.concatenate(curves) if curves else np.zeros(0)
        return torch.from_numpy(sorted_values[rank]).to(dtype)

    def max_count(self, nbytes: int) -> int:
        return 8 * nbytes + 1  # ranks take at least one bit each beyond a single value


def normalized_positions(count: int) -> np.ndarray:
    """``count`` points spread evenly over [-1, 1] (one point: 0)."""
    return np.linspace(-1.0, 1.0, count) if count > 1 else np.zeros(count)


def finite_coefficients(coefficients: np.ndarray) -> np.ndarray:
    """A model's float32 coefficients as float64, refused unless finite (a sender never fits others)."""
    if not np.isfinite(coefficients).all():
        raise PayloadError("curve-fit coefficients are not finite")
    return coefficients.astype(np.float64)
