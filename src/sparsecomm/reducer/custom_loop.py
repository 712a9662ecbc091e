"""`allreduce_gradients`: average named gradients over ranks in place, without DDP — a convenience
over `GradientReducer.allreduce_` for custom training loops and sparse embedding gradients."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.reducer.config import DENSE_BELOW
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.spec import PipelineSpec


def allreduce_gradients(named_gradients: Iterable[tuple[str, torch.Tensor]], spec_or_preset: str | PipelineSpec,
                        state: GradientReducer | None = None, *, group: dist.ProcessGroup | None = None,
                        seed: int = 0, nonfinite: str = "raise", dense_below: int = DENSE_BELOW) -> GradientReducer:
    """Replace each gradient by its average over ranks (see `GradientReducer.allreduce_`). Pass
    the returned reducer back in as ``state`` on the next step; a ``state`` built with other
    arguments raises `SparseCommError` rather than silently ignoring them."""
    if state is None:
        state = GradientReducer(spec_or_preset, group=group, seed=seed, nonfinite=nonfinite, dense_below=dense_below)
    else:
        state.check_matches(spec_or_preset, seed, nonfinite, dense_below)
        if group is not None and group is not state.group:
            raise SparseCommError("the state passed reduces over another process group than group=")
    state.allreduce_(named_gradients)
    return state


def check_optimizer(optimizer: torch.optim.Optimizer, reducer: GradientReducer) -> None:
    """Suit ``reducer`` to ``optimizer`` before the first step (`GradientReducer.suit_optimizer`):
    a pipeline that applies SGD's momentum itself (DGC's) under an optimizer with momentum of its
    own (SGD with momentum, AdamW) switches to error feedback on the gradient, with a warning that
    says so. Every rank calls it alike."""
    why = reducer.suit_optimizer(optimizer)
    if why is not None:
        warnings.warn(why, stacklevel=2)
