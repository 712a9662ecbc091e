"""`allreduce_gradients`: average named gradients over ranks in place, without DDP — for custom
training loops and sparse embedding gradients."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

from sparsecomm.integration.reducer import DENSE_BELOW, GradientReducer
from sparsecomm.spec import PipelineSpec


def allreduce_gradients(named_gradients: Iterable[tuple[str, torch.Tensor]], spec_or_preset: str | PipelineSpec,
                        state: GradientReducer | None = None, *, group: dist.ProcessGroup | None = None,
                        seed: int = 0, nonfinite: str = "raise", dense_below: int = DENSE_BELOW) -> GradientReducer:
    """Replace each gradient by its average over ranks (dense in place; sparse COO by ``copy_``),
    all tensors in flight at once. Pass the returned state back in on the next step."""
    reducer = state or GradientReducer(spec_or_preset, group=group, seed=seed, nonfinite=nonfinite,
                                       dense_below=dense_below)
    pending = [(tensor, reducer.reduce_async(name, tensor)) for name, tensor in named_gradients]
    for tensor, future in pending:
        averaged = future.wait()
        if averaged is not tensor:
            tensor.copy_(averaged)
    reducer.step_done()
    return reducer


def check_optimizer(optimizer: torch.optim.Optimizer, reducer: GradientReducer) -> None:
    """Warn when a pipeline that applies momentum itself (DGC) meets an optimizer with momentum."""
    if reducer.spec.feedback.name != "dgc_momentum":
        return
    for group in optimizer.param_groups:
        if group.get("momentum", 0) or group.get("betas"):
            warnings.warn("the dgc_momentum feedback applies momentum itself; use SGD without momentum, or the "
                          "momentum is applied twice", stacklevel=2)
            return
