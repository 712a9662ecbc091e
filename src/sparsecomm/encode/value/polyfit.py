"""``polyfit``: DeepReduce's piecewise polynomial fit of the sorted values, ``polyfit(degree=5, segments=8)``.

Each sorted part (see `curve_fit`) is cut where a point lies farthest (squared distance) from the
chord of its segment, one cut at a time, until there are ``segments`` pieces or no cut would leave
both sides at least ``degree + 1`` points. Each piece is fitted by least squares with a Chebyshev
series of degree ``min(degree, points - 1)`` on [-1, 1] (well conditioned in float32).

Model layout: piece count (u8), each piece's length (u32), then each piece's coefficients (f32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from numpy.polynomial import chebyshev

from sparsecomm.encode.base import VALUE_CODECS
from sparsecomm.encode.value.curve_fit import CurveFitValues, finite_coefficients, normalized_positions
from sparsecomm.errors import PayloadError, SparseCommError


def chord_cuts(curve: np.ndarray, segments: int, min_points: int) -> np.ndarray:
    """Piece boundaries [0, ..., len(curve)], cut greedily at the largest distance to a chord."""
    bounds = np.array([0, curve.size])
    points = np.arange(curve.size)
    while bounds.size - 1 < segments:
        piece = np.searchsorted(bounds, points, side="right") - 1
        start, end = bounds[piece], bounds[piece + 1] - 1
        span = np.maximum(end - start, 1)
        chord = curve[start] + (curve[end] - curve[start]) * (points - start) / span
        distance = (chord - curve) ** 2
        distance[(points - start < min_points) | (end + 1 - points < min_points)] = -1.0
        cut = int(np.argmax(distance))
        if distance[cut] <= 0.0:
            break
        bounds = np.insert(bounds, piece[cut] + 1, cut)
    return bounds


@VALUE_CODECS.register("polyfit")
@dataclass(frozen=True)
class PolyfitValues(CurveFitValues):
    degree: int = 5
    segments: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.degree <= 15:
            raise SparseCommError("polyfit degree must be in 0..15")
        if not 1 <= self.segments <= 255:
            raise SparseCommError("polyfit segments must be in 1..255")

    def fit(self, curve: np.ndarray) -> bytes:
        bounds = chord_cuts(curve, self.segments, self.degree + 1)
        lengths = np.diff(bounds)
        coefficients = [
            chebyshev.chebfit(normalized_positions(int(length)), curve[start:end], min(self.degree, int(length) - 1))
            for start, end, length in zip(bounds[:-1], bounds[1:], lengths, strict=True)
        ]
        return (struct.pack("<B", lengths.size) + lengths.astype("<u4").tobytes()
                + np.concatenate(coefficients).astype("<f4").tobytes())

    def evaluate(self, model: memoryview, count: int) -> np.ndarray:
        if len(model) < 1:
            raise PayloadError("polyfit model is empty")
        pieces = model[0]
        if pieces == 0 or len(model) < 1 + 4 * pieces:
            raise PayloadError("polyfit model is truncated")
        lengths = np.frombuffer(model, dtype="<u4", count=pieces, offset=1).astype(np.int64)
        if (lengths == 0).any() or int(lengths.sum()) != count:
            raise PayloadError(f"polyfit pieces do not cover {count} values")
        degrees = np.minimum(self.degree, lengths - 1)
        if len(model) != 1 + 4 * pieces + 4 * int((degrees + 1).sum()):
            raise PayloadError("polyfit coefficients do not match the pieces")
        coefficients = finite_coefficients(np.frombuffer(model, dtype="<f4", offset=1 + 4 * pieces))
        splits = np.cumsum(degrees + 1)[:-1]
        return np.concatenate([
            chebyshev.chebval(normalized_positions(int(length)), c)
            for length, c in zip(lengths, np.split(coefficients, splits), strict=True)
        ])
