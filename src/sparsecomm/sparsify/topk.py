"""``topk``: the k entries of largest magnitude, exactly (torch.topk)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, CountedSparsifier, gather


@SPARSIFIERS.register("topk")
@dataclass(frozen=True)
class TopK(CountedSparsifier):
    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        k = self.target_count(tensor.numel())
        _, indices = torch.topk(tensor.reshape(-1).abs(), k, sorted=False)
        return gather(tensor, indices)
