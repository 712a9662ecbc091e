"""``randomk``: k entries chosen uniformly at random without replacement (no rescaling: pair it
with ``residual`` feedback). The choice comes from the generator, so ranks seeded alike agree."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, CountedSparsifier, gather


@SPARSIFIERS.register("randomk")
@dataclass(frozen=True)
class RandomK(CountedSparsifier):
    seed: int = 0
    """Seeds a private generator when the caller passes none."""

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        if generator is None:
            generator = torch.Generator().manual_seed(self.seed)
        numel = tensor.numel()
        chosen = uniform_subset(numel, self.target_count(numel), generator)
        return gather(tensor, chosen.to(tensor.device))


def uniform_subset(numel: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """k distinct indices of [0, numel), every k-subset equally likely. For small k: draw with
    replacement and keep first occurrences (sequential sampling without replacement), which costs
    O(k log k) instead of the O(numel) of a full permutation."""
    device = generator.device
    if 4 * k < numel:
        draws_count = k + (2 * k * k) // numel + 16
        draws = torch.randint(numel, (draws_count,), generator=generator, device=device)
        unique, inverse = torch.unique(draws, return_inverse=True)
        if unique.numel() >= k:
            positions = torch.arange(draws_count, device=device)
            first = torch.full((unique.numel(),), draws_count, dtype=torch.int64, device=device)
            first.scatter_reduce_(0, inverse, positions, reduce="amin")
            return unique[torch.argsort(first)[:k]]
    return torch.randperm(numel, generator=generator, device=device)[:k]
