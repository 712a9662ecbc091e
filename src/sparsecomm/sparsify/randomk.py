"""``randomk``: k entries chosen uniformly at random without replacement (no rescaling: pair it
with ``residual`` feedback). The choice comes from the generator, so ranks seeded alike agree."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.registry import SPARSIFIERS
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import Sparsifier, check_ratio_or_count, count_from, gather


@SPARSIFIERS.register("randomk")
@dataclass(frozen=True)
class RandomK(Sparsifier):
    ratio: float | None = None
    k: int | None = None
    seed: int = 0
    """Seeds a private generator when the caller passes none."""

    def __post_init__(self) -> None:
        check_ratio_or_count("randomk", self.ratio, self.k)

    def target_count(self, numel: int) -> int:
        return count_from(numel, self.ratio, self.k)

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        if generator is None:
            generator = torch.Generator().manual_seed(self.seed)
        numel = tensor.numel()
        k = self.target_count(numel)
        chosen = torch.randperm(numel, generator=generator, device=generator.device)[:k]
        return gather(tensor, chosen.to(tensor.device))
