"""``topk``: the k entries of largest magnitude, exactly (torch.topk)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import (
    SPARSIFIERS,
    Sparsifier,
    check_ratio_or_count,
    check_warmup,
    count_from,
    gather,
    with_warmup,
)


@SPARSIFIERS.register("topk")
@dataclass(frozen=True)
class TopK(Sparsifier):
    ratio: float | None = None
    k: int | None = None
    warmup: int = 0
    """steps of DGC's exponential warm-up before ``ratio`` applies (ratio-based only)"""

    def __post_init__(self) -> None:
        check_ratio_or_count("topk", self.ratio, self.k)
        check_warmup("topk", self.ratio, self.warmup)

    def at_step(self, step: int) -> Sparsifier:
        return with_warmup(self, step)

    def target_count(self, numel: int) -> int:
        return count_from(numel, self.ratio, self.k)

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        k = self.target_count(tensor.numel())
        _, indices = torch.topk(tensor.reshape(-1).abs(), k, sorted=False)
        return gather(tensor, indices)
