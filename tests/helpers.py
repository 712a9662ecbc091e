"""Test helpers: random sparse gradients of every awkward shape."""

from __future__ import annotations

import numpy as np
import torch

from sparsecomm import SparseGradient

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_sparse(numel: int, nnz: int, seed: int, dtype: torch.dtype = torch.float32,
                  shape: tuple[int, ...] | None = None, shuffled: bool = True) -> SparseGradient:
    """``nnz`` distinct random indices of ``numel`` with normal values (never exactly zero)."""
    rng = np.random.default_rng(seed)
    indices = rng.choice(numel, size=nnz, replace=False) if nnz else np.zeros(0, dtype=np.int64)
    if not shuffled:
        indices = np.sort(indices)
    values = rng.standard_normal(nnz).astype(np.float32) + np.float32(1e-3)
    return SparseGradient(
        torch.from_numpy(indices.astype(np.int64)),
        torch.from_numpy(values).to(dtype),
        torch.Size(shape if shape is not None else (numel,)),
    )
