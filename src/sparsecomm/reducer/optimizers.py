"""Which feedback suits the optimizer. A feedback that applies SGD's momentum itself (DGC's momentum
correction, `Feedback.applies_momentum`) must not meet an optimizer that applies its own — SGD with
momentum, Adam and its kin — or the momentum is applied twice. Error feedback on the gradient
(``residual``) leaves the momentum to the optimizer, and suits every optimizer."""

from __future__ import annotations

import torch

from sparsecomm.feedback.base import Feedback
from sparsecomm.feedback.residual import Residual


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


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a trainer's wrapper holds (Accelerate's ``optimizer``, Lightning's ``_optimizer``)."""
    for attribute in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, torch.optim.Optimizer):
            return _unwrapped(inner)
    return optimizer
