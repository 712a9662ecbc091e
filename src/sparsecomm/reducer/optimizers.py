"""Which pipeline suits the optimizer. A feedback that applies SGD's momentum itself (DGC's momentum
correction, `Feedback.applies_momentum`) must not meet an optimizer that applies its own — SGD with
momentum, Adam and its kin — or the momentum is applied twice. Error feedback on the gradient
(``residual``) leaves the momentum to the optimizer, and suits every optimizer. An optimizer other
than SGD normalizes the gradient, so under it ``adaptive`` eases sparsity in (``warmup=-1``:
`WARMUP` steps), holds no entry back for long (``floor=0``: `NORMALIZED_FLOOR`), and, asked for
low-rank steps by the optimizer (``low_rank=-1``), sends them at rank `NORMALIZED_RANK`."""

from __future__ import annotations

from dataclasses import replace

import torch

from sparsecomm.feedback.base import Feedback
from sparsecomm.feedback.residual import Residual
from sparsecomm.sparsify.adaptive import NORMALIZED_FLOOR, NORMALIZED_RANK, WARMUP, Adaptive
from sparsecomm.spec import PipelineSpec


def applies_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps a momentum of its own (SGD's ``momentum``, Adam's ``betas``)."""
    return any(group.get("momentum", 0) or group.get("betas") for group in optimizer.param_groups)


def suited_feedback(feedback: Feedback, optimizer: torch.optim.Optimizer) -> tuple[Feedback, str | None]:
    """(the feedback to use with ``optimizer``, why it differs from ``feedback``, or None)."""
    if not feedback.applies_momentum or not applies_momentum(optimizer):
        return feedback, None
    name = type(_unwrapped(optimizer)).__name__
    return Residual(), (f"{feedback.to_spec()} applies SGD's momentum itself and {name} applies its own: this "
                        f"reducer uses residual instead (error feedback on the gradient; {name} keeps the "
                        "momentum). For DGC's momentum correction, use SGD without momentum.")


def suited_spec(spec: PipelineSpec, optimizer: torch.optim.Optimizer) -> tuple[PipelineSpec, str | None]:
    """(the spec to use with ``optimizer``, why its feedback differs, or None): `suited_feedback`,
    and, under an optimizer other than SGD, ``adaptive``'s choices left to the optimizer made:
    ``warmup=-1`` `WARMUP`, ``floor=0`` `NORMALIZED_FLOOR`, ``low_rank=-1`` `NORMALIZED_RANK`."""
    feedback, why = suited_feedback(spec.feedback, optimizer)
    suited = replace(spec, feedback=feedback)
    sparsifier = spec.sparsifier
    if isinstance(sparsifier, Adaptive) and normalizes(optimizer):
        warmup = WARMUP if sparsifier.warmup == -1 else sparsifier.warmup
        floor = sparsifier.floor or NORMALIZED_FLOOR
        low_rank = NORMALIZED_RANK if sparsifier.low_rank == -1 else sparsifier.low_rank
        suited = replace(suited, sparsifier=replace(sparsifier, warmup=warmup, floor=floor, low_rank=low_rank))
    return suited, why


def normalizes(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step is not linear in the gradient: any but SGD (Adam's kin scale each
    entry by its second moment)."""
    return not isinstance(_unwrapped(optimizer), torch.optim.SGD)


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a wrapper holds (Accelerate's ``optimizer``, Lightning's ``_optimizer``, the
    local optimizer of torch's ``ZeroRedundancyOptimizer`` in ``optim``)."""
    for attribute in ("optimizer", "_optimizer", "optim"):
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, torch.optim.Optimizer):
            return _unwrapped(inner)
    return optimizer


def suited_once_begun(spec: PipelineSpec, optimizer: torch.optim.Optimizer,
                      begun: bool) -> tuple[PipelineSpec, str | None, str]:
    """`suited_spec` for a reducer whose steps may have ``begun``: (the spec to go on with, why its
    feedback changed or None, why it must not change — "" where nothing is refused). Once the
    steps have begun the spec stays: a feedback change is refused, ``adaptive``'s choices are
    kept."""
    suited, why = suited_spec(spec, optimizer)
    if suited == spec or not begun:
        return suited, why, ""
    refused = "" if why is None else (f"{why} — but this reducer has already reduced gradients: suit it to the "
                                      "optimizer before the first step")
    return spec, None, refused
