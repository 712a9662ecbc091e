"""The sparsifier interface and the ratio-or-count parameter most sparsifiers share."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, replace
from types import ModuleType

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

    def sends_whole(self, shape: torch.Size, dense_below: int) -> bool:
        """Whether a tensor of ``shape`` goes whole — every nonzero, no selection — rather than
        through this sparsifier: by default one smaller than ``dense_below`` (the reducer's), since
        selecting from it saves little."""
        return math.prod(shape) < dense_below

    def selects_rows(self) -> bool:
        """Whether a sparse gradient (an ``nn.Embedding(sparse=True)``'s rows) goes through this
        sparsifier as the dense tensor it stands for, rather than whole, row by row: by default
        not, as the seeds that sum sparse gradients (SparCML, S2, DeepReduce, SKCompress) send a
        sparse gradient's own entries."""
        return False


WARMUP_STAGES = 4
WARMUP_BASE = 0.25


@dataclass(frozen=True)
class CountedSparsifier(Sparsifier):
    """Base of the sparsifiers that aim at a count: ``k`` entries, or a ``ratio`` of the tensor,
    optionally reached through DGC's exponential ``warmup``. Subclasses apply `count` to whatever
    unit they select (entries, blocks, entries per bucket)."""

    ratio: float | None = None
    k: int | None = None
    warmup: int = 0
    """steps of DGC's exponential warm-up before ``ratio`` applies (ratio-based only)"""

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.k is None):
            raise SparseCommError(f"{self.name} takes exactly one of ratio= or k=")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise SparseCommError(f"{self.name} ratio must be in (0, 1], got {self.ratio}")
        if self.k is not None and self.k < 0:
            raise SparseCommError(f"{self.name} k must be >= 0, got {self.k}")
        if self.warmup < 0:
            raise SparseCommError(f"{self.name} warmup must be >= 0 steps")
        if self.warmup and self.ratio is None:
            raise SparseCommError(f"{self.name} warmup needs ratio= (a schedule of densities), not k=")

    def count(self, units: int) -> int:
        """How many of ``units`` to keep: k if given, else ceil(ratio·units), at least 1 of a
        non-empty set; never more than ``units``."""
        return count_from(units, self.ratio, self.k)

    def target_count(self, numel: int) -> int:
        return self.count(numel)

    def at_step(self, step: int) -> Sparsifier:
        if not self.warmup or self.ratio is None:
            return self
        return replace(self, ratio=warmup_ratio(self.ratio, step, self.warmup), warmup=0)


def warmup_ratio(final: float, step: int, warmup_steps: int) -> float:
    """DGC's exponential warm-up (§3.3, its schedule in §4.1): over ``warmup_steps`` split into 4
    equal stages the density is 0.25, 0.0625, 0.015625, 0.0039 (sparsity 75%, 93.75%, 98.4375%,
    99.6%), never below ``final``; from then on ``final`` (99.9% for ratio=0.001)."""
    if step >= warmup_steps:
        return final
    stage = step * WARMUP_STAGES // warmup_steps
    return max(final, WARMUP_BASE ** (stage + 1))


def count_from(numel: int, ratio: float | None, k: int | None) -> int:
    """k if given, else ceil(ratio·numel) (at least 1 for a non-empty tensor); never above numel."""
    if k is not None:
        return min(k, numel)
    assert ratio is not None
    return min(numel, max(1, math.ceil(ratio * numel - 1e-9))) if numel else 0


def gather(tensor: torch.Tensor, indices: torch.Tensor) -> SparseGradient:
    flat = tensor.reshape(-1)
    return SparseGradient(indices, flat[indices], tensor.shape)


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""dtypes the GPU kernels take: their magnitudes compare exactly in float32 inside them"""


TRITON_MIN_NUMEL = 1 << 21
"""the least tensor the Triton kernels serve: from about this size on they beat torch's ops per
call; below it they would only add their start, paid once in each process (the kernels' first call
compiles or loads them)"""


def gpu_kernels(tensor: torch.Tensor, module: str) -> ModuleType | None:
    """The Triton kernels of ``sparsecomm.sparsify.<module>`` where they serve ``tensor`` (on a
    GPU, of a `TRITON_DTYPES` dtype, at least `TRITON_MIN_NUMEL` entries, Triton installed); None
    where torch's own ops must."""
    if tensor.device.type != "cuda" or tensor.dtype not in TRITON_DTYPES or tensor.numel() < TRITON_MIN_NUMEL:
        return None
    try:
        return importlib.import_module(f"sparsecomm.sparsify.{module}")
    except ImportError:  # no Triton
        return None


SPARSIFIERS: Registry[Sparsifier] = Registry("sparsifier")
"""every sparsifier, by name (``@SPARSIFIERS.register("name")`` adds one)"""
