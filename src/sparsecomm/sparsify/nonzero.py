"""``nonzero``: send every nonzero entry — for gradients that are sparse already (embeddings)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, Sparsifier


@SPARSIFIERS.register("nonzero")
@dataclass(frozen=True)
class Nonzero(Sparsifier):
    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        return SparseGradient.from_dense(tensor)
