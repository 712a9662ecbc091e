"""`allreduce_gradients`: average named gradients over ranks in place, without DDP — a convenience
over `GradientReducer.allreduce_` for custom training loops and sparse embedding gradients."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.presets import resolve
from sparsecomm.reducer.config import DENSE_BELOW
from sparsecomm.reducer.hierarchical import HierarchicalReducer
from sparsecomm.reducer.named import agree_on_step, by_name
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.spec import PipelineSpec


def allreduce_gradients(named_gradients: Iterable[tuple[str, torch.Tensor]], spec_or_preset: str | PipelineSpec,
                        state: GradientReducer | None = None, *, group: dist.ProcessGroup | None = None,
                        seed: int = 0, nonfinite: str = "raise", dense_below: int = DENSE_BELOW) -> GradientReducer:
    """Replace each gradient by its average over ranks (see `GradientReducer.allreduce_`). Pass
    the returned reducer back in as ``state`` on the next step; a ``state`` built with other
    arguments raises `SparseCommError` rather than silently ignoring them.

    Args:
        named_gradients: (name, gradient) pairs; every rank passes the same names, in any order.
        spec_or_preset: a preset name or a pipeline spec string.
        state: the reducer this function returned on the previous step (None on the first).
        group: the process group (default: the world).
        seed: seeds every random choice; every rank must pass the same.
        nonfinite: ``"raise"``, ``"propagate"``, ``"skip"`` or ``"zero"`` (see `GradientReducer`).
        dense_below: tensors with fewer elements take a plain fp32 all_reduce.

    Returns:
        The reducer, to pass back as ``state``; ``close()`` it when training ends.

    Raises:
        SparseCommError: ``state`` was built with other arguments or another group, the ranks
            disagree, or a gradient is non-finite under ``nonfinite="raise"`` — on every rank.

    Example:
        ```python ranks=2
        import torch

        import sparsecomm as sc

        weight = torch.nn.Parameter(torch.randn(100, 100))
        state = None
        for step in range(3):
            weight.grad = torch.randn(100, 100)
            state = sc.allreduce_gradients([("weight", weight.grad)], "topk(ratio=0.05)+residual+rice", state)
        print(state.stats.summary()["compression_ratio"])
        state.close()
        ```
    """
    if state is None:
        state = GradientReducer(spec_or_preset, group=group, seed=seed, nonfinite=nonfinite, dense_below=dense_below)
    elif refused := _mismatch(state, spec_or_preset, group, seed, nonfinite, dense_below):
        # this rank alone may have passed it: it refuses the step's agreement, where the others meet it
        named = by_name(named_gradients)
        agree_on_step(state.group, named, state.stats.steps, len(named), 0, refused)
    state.allreduce_(named_gradients)
    return state


def _mismatch(state: GradientReducer, spec: str | PipelineSpec, group: dist.ProcessGroup | None, seed: int,
              nonfinite: str, dense_below: int) -> str:
    """Why ``state`` is not a reducer built with these arguments ("" where it is); the spec it was
    built with names the one `GradientReducer.suit_optimizer` made of it."""
    if group is not None and group is not state.group:
        return "the state passed reduces over another process group than group="
    asked = resolve(spec)
    try:
        state.config.check_matches(replace(state.config, spec=state.spec if asked == state.built_with else asked,
                                           seed=seed, nonfinite=nonfinite, dense_below=dense_below))
    except SparseCommError as err:
        return str(err)
    return ""


def check_optimizer(optimizer: torch.optim.Optimizer, reducer: GradientReducer | HierarchicalReducer) -> None:
    """Suit ``reducer`` to ``optimizer`` before the first step (`GradientReducer.suit_optimizer`):
    a pipeline that applies SGD's momentum itself (DGC's) under an optimizer with momentum of its
    own (SGD with momentum, AdamW) switches to error feedback on the gradient, with a warning that
    says so. Every rank calls it alike.

    Args:
        optimizer: the optimizer that will apply the averaged gradients.
        reducer: the reducer that averages them.

    Raises:
        SparseCommError: the reducer's feedback must change after its first step, or the ranks
            differ (see `GradientReducer.suit_optimizer`).

    Example:
        ```python ranks=2
        import warnings

        import torch

        import sparsecomm as sc

        model = torch.nn.Linear(128, 64)
        with sc.GradientReducer("dgc", model=model) as reducer, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sc.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), reducer)
        print(caught[0].message)   # DGC applies momentum itself: the optimizer's would be applied twice
        ```
    """
    why = reducer.suit_optimizer(optimizer)
    if why is not None:
        warnings.warn(why, stacklevel=2)
