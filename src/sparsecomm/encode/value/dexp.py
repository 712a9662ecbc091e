"""``dexp``: DeepReduce's double-exponential fit of the sorted values, y = a·e^(bx) + c·e^(dx).

Each sorted part (see `curve_fit`), on x in [0, 1], is fitted by variable projection: for given
rates (b, d) the best (a, c) is a 2×2 least-squares solve, so only the rates are searched — first
over a grid of rate pairs (all pairs at once from one Gram matrix), then by a few
Levenberg–Marquardt steps. When no pair gives a finite, well-posed fit, or a part has fewer than
four points, the part falls back to a cubic Chebyshev fit (flagged in its model).

Model layout: kind (u8); kind 0: a, b, c, d as f64; kind 1: Chebyshev coefficients as f32.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from numpy.polynomial import chebyshev

from sparsecomm.encode.base import VALUE_CODECS
from sparsecomm.encode.value.curve_fit import CurveFitValues, finite_coefficients, normalized_positions
from sparsecomm.errors import PayloadError, SparseCommError

RATE_GRID = np.array([-1024.0, -256.0, -64.0, -16.0, -8.0, -4.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
EXPONENTIAL, POLYNOMIAL = 0, 1
FALLBACK_DEGREE = 3
_PARAMETERS = struct.Struct("<4d")


def _amplitudes(x: np.ndarray, curve: np.ndarray, b: float, d: float) -> tuple[np.ndarray, float]:
    """Best (a, c) for rates (b, d) and the squared error; error inf when ill-posed."""
    with np.errstate(over="ignore"):
        basis = np.exp(np.outer([b, d], x))
    if not np.isfinite(basis).all():
        return np.zeros(2), np.inf
    solution, _, rank, _ = np.linalg.lstsq(basis.T, curve, rcond=None)
    if rank < 2 or not np.isfinite(solution).all():
        return solution, np.inf
    return solution, float(np.sum((basis.T @ solution - curve) ** 2))


def fit_double_exponential(x: np.ndarray, curve: np.ndarray, steps: int) -> tuple[np.ndarray, float] | None:
    """(a, b, c, d) and squared error of the best fit found, or None."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        basis = np.exp(np.outer(RATE_GRID, x))
        gram, projection = basis @ basis.T, basis @ curve
        i, j = np.triu_indices(RATE_GRID.size, 1)
        det = gram[i, i] * gram[j, j] - gram[i, j] ** 2
        a = (gram[j, j] * projection[i] - gram[i, j] * projection[j]) / det
        c = (gram[i, i] * projection[j] - gram[i, j] * projection[i]) / det
        explained = a * projection[i] + c * projection[j]
        explained[~np.isfinite(explained) | (det <= 1e-12 * gram[i, i] * gram[j, j])] = -np.inf
    if not np.isfinite(explained).any():
        return None
    best = int(np.argmax(explained))
    rates = np.array([RATE_GRID[i[best]], RATE_GRID[j[best]]])
    amplitudes, error = _amplitudes(x, curve, *rates)
    damping = 1e-3
    for _ in range(steps):  # Levenberg–Marquardt on the rates, amplitudes projected out
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            residual = np.exp(np.outer(rates, x)).T @ amplitudes - curve
            jacobian = (x * np.exp(np.outer(rates, x)) * amplitudes[:, None]).T
            normal = jacobian.T @ jacobian
            try:
                step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -jacobian.T @ residual)
            except np.linalg.LinAlgError:
                break
        if not np.isfinite(step).all():
            break
        trial_amplitudes, trial_error = _amplitudes(x, curve, *(rates + step))
        if trial_error < error:
            rates, amplitudes, error, damping = rates + step, trial_amplitudes, trial_error, damping / 4
        else:
            damping *= 8
    if not np.isfinite(error):
        return None
    return np.array([amplitudes[0], rates[0], amplitudes[1], rates[1]]), error


@VALUE_CODECS.register("dexp")
@dataclass(frozen=True)
class DoubleExponentialValues(CurveFitValues):
    steps: int = 8
    """Levenberg–Marquardt steps after the grid search."""

    def __post_init__(self) -> None:
        if not 0 <= self.steps <= 100:
            raise SparseCommError("dexp steps must be in 0..100")

    def fit(self, curve: np.ndarray) -> bytes:
        x = (normalized_positions(curve.size) + 1.0) / 2.0
        found = fit_double_exponential(x, curve, self.steps) if curve.size >= 4 else None
        if found is not None:
            return struct.pack("<B", EXPONENTIAL) + _PARAMETERS.pack(*found[0])
        degree = min(FALLBACK_DEGREE, curve.size - 1)
        coefficients = chebyshev.chebfit(normalized_positions(curve.size), curve, degree)
        return struct.pack("<B", POLYNOMIAL) + coefficients.astype("<f4").tobytes()

    def evaluate(self, model: memoryview, count: int) -> np.ndarray:
        if len(model) < 1:
            raise PayloadError("dexp model is empty")
        if model[0] == EXPONENTIAL and len(model) == 1 + _PARAMETERS.size:
            a, b, c, d = _PARAMETERS.unpack_from(model, 1)
            x = (normalized_positions(count) + 1.0) / 2.0
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                return np.asarray(a * np.exp(b * x) + c * np.exp(d * x))
        if model[0] == POLYNOMIAL and 5 <= len(model) <= 1 + 4 * (FALLBACK_DEGREE + 1) and len(model) % 4 == 1:
            coefficients = finite_coefficients(np.frombuffer(model, dtype="<f4", offset=1))
            return np.asarray(chebyshev.chebval(normalized_positions(count), coefficients))
        raise PayloadError("dexp model is malformed")
