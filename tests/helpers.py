"""Test helpers: random sparse gradients of every awkward shape, per-rank contributions to a sum, and
what error feedback conserves over steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sparsecomm import SparseCommError, SparseGradient

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


def contribution(rank: int, world: int, overlap: str, numel: int = 20_000, nnz: int = 150) -> torch.Tensor:
    """Rank ``rank``'s gradient; ``overlap`` says how the ranks' supports meet (random, none, full,
    rank0_empty, all_empty, or dense_result: enough nonzeros that the sum turns dense)."""
    generator = torch.Generator().manual_seed(100 + rank)
    grad = torch.zeros(numel)
    if overlap == "random":
        indices = torch.randperm(numel, generator=generator)[:nnz]
    elif overlap == "none":
        indices = torch.arange(rank, nnz * world, world)
    elif overlap == "full":
        indices = torch.randperm(numel, generator=torch.Generator().manual_seed(7))[:nnz]
    elif overlap == "rank0_empty":
        indices = torch.randperm(numel, generator=generator)[: (0 if rank == 0 else nnz)]
    elif overlap == "all_empty":
        indices = torch.zeros(0, dtype=torch.int64)
    else:  # dense_result: enough nonzeros that the reduced streams switch to dense
        indices = torch.randperm(numel, generator=generator)[: numel // 3]
    grad[indices] = torch.randn(indices.numel(), generator=generator)
    return grad


def adaptive_at_once() -> str:
    """The ``adaptive`` preset's spec sparse at its floor density from the first step whatever the
    optimizer (under AdamW its least density falls from 25% over the first 20 steps, and its steps
    go low-rank): for tests of what sparse steps do within a few steps."""
    from dataclasses import replace

    from sparsecomm.presets import resolve
    from sparsecomm.spec import format_spec

    preset = resolve("adaptive")
    return format_spec(replace(preset, sparsifier=replace(preset.sparsifier, warmup=0, low_rank=0)))


def fed_and_conserved(reducer, rank: int, world: int, numel: int, steps: int) -> dict:
    """``steps`` random gradients of ``numel`` entries through ``reducer`` (a residual pipeline,
    under the name "weight"): what every rank fed in, and what every rank was given plus what every
    rank's residual still holds, which error feedback keeps equal; ``scale`` bounds the rounding."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(rank)
    fed, delivered = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for _ in range(steps):
        grad = torch.randn(numel, generator=generator)
        fed += grad
        delivered += reducer.reduce("weight", grad)
    held = reducer.pipeline.states["weight"].feedback["residual"].reshape(-1).double()
    dist.all_reduce(fed)
    dist.all_reduce(held)
    return {"fed": fed, "delivered_and_held": delivered * world + held,
            "scale": max(float(held.abs().max()), float(delivered.abs().max()) * world)}


def outcome(call: Callable[..., Any], *args: Any, done: str = "ok") -> str:
    """``done`` where ``call(*args)`` returns, else the `SparseCommError` it raised, as text: what a
    worker reports of a call every rank must refuse alike."""
    try:
        call(*args)
        return done
    except SparseCommError as err:
        return str(err)
