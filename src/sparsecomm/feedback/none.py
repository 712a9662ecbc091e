"""``none``: no memory between steps; what is not sent is dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsecomm.feedback.base import FEEDBACKS, Feedback
from sparsecomm.sparse_gradient import SparseGradient


@FEEDBACKS.register("none")
@dataclass(frozen=True)
class NoFeedback(Feedback):
    def accumulate(self, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        return grad

    def update(self, accumulated: torch.Tensor, sent: SparseGradient, state: dict[str, Any]) -> None:
        return None
