"""The sparsifier interface and the ratio-or-count parameter most sparsifiers share."""

from __future__ import annotations

import math

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.registry import Component
from sparsecomm.sparse_gradient import SparseGradient


class Sparsifier(Component):
    """Chooses which entries of a dense tensor to send. Randomness only from ``generator``, which
    every rank seeds alike; never from the global RNG."""

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        raise NotImplementedError

    def target_count(self, numel: int) -> int | None:
        """How many entries it aims to select from ``numel`` (None if it has no target)."""
        return None


def check_ratio_or_count(name: str, ratio: float | None, k: int | None) -> None:
    if (ratio is None) == (k is None):
        raise SparseCommError(f"{name} takes exactly one of ratio= or k=")
    if ratio is not None and not 0.0 < ratio <= 1.0:
        raise SparseCommError(f"{name} ratio must be in (0, 1], got {ratio}")
    if k is not None and k < 0:
        raise SparseCommError(f"{name} k must be >= 0, got {k}")


def count_from(numel: int, ratio: float | None, k: int | None) -> int:
    """k if given, else ceil(ratio·numel) (at least 1 for a non-empty tensor); never above numel."""
    if k is not None:
        return min(k, numel)
    assert ratio is not None
    return min(numel, max(1, math.ceil(ratio * numel - 1e-9))) if numel else 0


def gather(tensor: torch.Tensor, indices: torch.Tensor) -> SparseGradient:
    flat = tensor.reshape(-1)
    return SparseGradient(indices, flat[indices], tensor.shape)
