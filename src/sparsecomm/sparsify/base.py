"""The sparsifier interface and the ratio-or-count parameter most sparsifiers share."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.registry import Component, Registry
from sparsecomm.sparse_gradient import SparseGradient


class Sparsifier(Component):
    """Chooses which entries of a dense tensor to send. Randomness only from ``generator``, which
    every rank seeds alike; never from the global RNG."""

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        raise NotImplementedError

    def target_count(self, numel: int) -> int | None:
        """How many entries it aims to select from ``numel`` (None if it has no target)."""
        return None

    def at_step(self, step: int) -> Sparsifier:
        """The sparsifier to use at ``step`` (itself unless it has a warm-up schedule)."""
        return self


WARMUP_STAGES = 4
WARMUP_BASE = 0.25


def with_warmup(sparsifier: Sparsifier, step: int) -> Sparsifier:
    """``sparsifier`` (which has ``ratio`` and ``warmup`` fields) at ``step`` of its warm-up."""
    ratio, warmup = getattr(sparsifier, "ratio", None), getattr(sparsifier, "warmup", 0)
    if not warmup or ratio is None:
        return sparsifier
    return replace(sparsifier, ratio=warmup_ratio(ratio, step, warmup), warmup=0)  # type: ignore[type-var]


def warmup_ratio(final: float, step: int, warmup_steps: int) -> float:
    """DGC's exponential warm-up (§3.4): over ``warmup_steps`` split into 4 equal stages the density
    is 0.25, 0.0625, 0.015625, 0.0039 (sparsity 75%, 93.75%, 98.4375%, 99.6%), never below ``final``;
    from then on ``final`` (99.9% for ratio=0.001)."""
    if step >= warmup_steps:
        return final
    stage = step * WARMUP_STAGES // warmup_steps
    return max(final, WARMUP_BASE ** (stage + 1))


def check_ratio_or_count(name: str, ratio: float | None, k: int | None) -> None:
    if (ratio is None) == (k is None):
        raise SparseCommError(f"{name} takes exactly one of ratio= or k=")
    if ratio is not None and not 0.0 < ratio <= 1.0:
        raise SparseCommError(f"{name} ratio must be in (0, 1], got {ratio}")
    if k is not None and k < 0:
        raise SparseCommError(f"{name} k must be >= 0, got {k}")


def check_warmup(name: str, ratio: float | None, warmup: int) -> None:
    if warmup < 0:
        raise SparseCommError(f"{name} warmup must be >= 0 steps")
    if warmup and ratio is None:
        raise SparseCommError(f"{name} warmup needs ratio= (a schedule of densities), not k=")


def count_from(numel: int, ratio: float | None, k: int | None) -> int:
    """k if given, else ceil(ratio·numel) (at least 1 for a non-empty tensor); never above numel."""
    if k is not None:
        return min(k, numel)
    assert ratio is not None
    return min(numel, max(1, math.ceil(ratio * numel - 1e-9))) if numel else 0


def gather(tensor: torch.Tensor, indices: torch.Tensor) -> SparseGradient:
    flat = tensor.reshape(-1)
    return SparseGradient(indices, flat[indices], tensor.shape)


SPARSIFIERS: Registry[Sparsifier] = Registry("sparsifier")
"""every sparsifier, by name (``@SPARSIFIERS.register("name")`` adds one)"""
