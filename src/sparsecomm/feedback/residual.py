"""``residual``: error feedback (SparCML Algorithm 1; DGC's local accumulation without momentum).

    acc ← residual + grad;  send Q(sparsify(acc));  residual ← acc − Q(sparsify(acc))

The residual keeps everything not yet delivered, including quantization error when the value
codec is lossy, so over any number of steps  sum(sent) + residual = sum(grad).
The residual is one buffer per tensor, updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsecomm.feedback.base import FEEDBACKS, Feedback, add_at, flush_into, held, holds, subtract_sent
from sparsecomm.sparse_gradient import SparseGradient


@FEEDBACKS.register("residual")
@dataclass(frozen=True)
class Residual(Feedback):
    keeps_lost = True

    def accumulate(self, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        return held(state, "residual", grad).add_(grad)

    def update(self, accumulated: torch.Tensor, sent: SparseGradient, state: dict[str, Any]) -> None:
        subtract_sent(accumulated, sent)
        state["clear"] = False

    def take_back(self, lost: SparseGradient, state: dict[str, Any]) -> None:
        add_at(state, "residual", lost)
        state["clear"] = False

    def flush_reads_only(self, grad: torch.Tensor, state: dict[str, Any], wire_dtype: torch.dtype,
                         scale: float = 1.0) -> bool:
        """While the residual is known to be zero, an exact flush sends the gradient alone."""
        return (bool(state.get("clear")) and holds(state, "residual", grad) and scale == 1.0
                and wire_dtype == grad.dtype)

    def flush(self, grad: torch.Tensor, state: dict[str, Any], out: torch.Tensor, scale: float = 1.0) -> None:
        """grad + residual into ``out``; the residual keeps what ``out`` lost (`Feedback.flush`,
        without indices; while the residual is known to be zero, grad goes straight to ``out``)."""
        if state.get("clear") and holds(state, "residual", grad):
            if scale == 1.0 and out.dtype == grad.dtype:
                out.copy_(grad.reshape(-1))
                return
            residual = held(state, "residual", grad).copy_(grad)
        else:
            residual = self.accumulate(grad, state)
        state["clear"] = flush_into(residual, out, scale)
