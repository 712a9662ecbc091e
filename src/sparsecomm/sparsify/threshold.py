"""``threshold``: every entry with |g| ≥ value (Strom's fixed threshold)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.registry import SPARSIFIERS
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import Sparsifier, gather


@SPARSIFIERS.register("threshold")
@dataclass(frozen=True)
class Threshold(Sparsifier):
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.value <= 0:
            raise SparseCommError("threshold value must be > 0")

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        indices = torch.nonzero(tensor.reshape(-1).abs() >= self.value).squeeze(1)
        return gather(tensor, indices)
