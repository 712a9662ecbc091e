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

    def flush_reads_only(self, grad: torch.Tensor, state: dict[str, Any], wire_dtype: torch.dtype,
                         scale: float = 1.0) -> bool:
        """Nothing is held, so nothing changes."""
        return True
