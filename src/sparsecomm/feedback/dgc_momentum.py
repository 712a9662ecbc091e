"""``dgc_momentum``: Deep Gradient Compression's local accumulation with momentum correction (§3.2,
eq. 7; Nesterov: App. B, eq. 10), momentum factor masking (§3.3) and local gradient clipping
(App. C).

    plain:     u ← m·u + g;       v ← v + u
    Nesterov:  u ← m·(u + g);     v ← v + u + g
    send sparse(v);  v ← v − sent;  with masking, u ← 0 where sent

The momentum lives here, so the optimizer must be plain SGD **without** momentum (a second
momentum would be applied on top; `sparsecomm.check_optimizer` warns about it). Local clipping
rescales this tensor's gradient to L2 norm at most ``clip``·``world_size``^(−1/2) before it is
accumulated (the global threshold ``clip`` split evenly over the ranks' gradients); 0 turns it off.
With a lossy value codec, v keeps what quantization lost (error feedback) instead of being zeroed.

Tensors the reducer sends uncompressed (small ones, sparse embedding rows) get the same momentum
after the average over ranks (`update_uncompressed`), as an SGD optimizer's momentum would give
them: the optimizer has none, so without it they would train with none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.feedback.base import FEEDBACKS, Feedback, flush_into, subtract_sent
from sparsecomm.sparse_gradient import SparseGradient


@FEEDBACKS.register("dgc_momentum")
@dataclass(frozen=True)
class DGCMomentum(Feedback):
    momentum: float = 0.9
    nesterov: bool = False
    masking: bool = True
    clip: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise SparseCommError("dgc_momentum momentum must be in [0, 1)")
        if self.clip < 0:
            raise SparseCommError("dgc_momentum clip must be >= 0 (0: off)")

    def accumulate(self, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        velocity: torch.Tensor | None = state.get("momentum")
        if velocity is None or velocity.shape != grad.shape or velocity.dtype != grad.dtype:
            state["momentum"], state["accumulated"] = torch.zeros_like(grad), torch.zeros_like(grad)
        velocity, accumulated = state["momentum"], state["accumulated"]
        if self.clip > 0:
            threshold = self.clip / math.sqrt(state.get("world_size", 1))
            norm = float(torch.linalg.vector_norm(grad))
            if norm > threshold:
                grad = grad * (threshold / norm)
        if self.nesterov:
            velocity.add_(grad).mul_(self.momentum)
            accumulated.add_(velocity).add_(grad)
        else:
            velocity.mul_(self.momentum).add_(grad)
            accumulated.add_(velocity)
        return accumulated

    def update(self, accumulated: torch.Tensor, sent: SparseGradient, state: dict[str, Any]) -> None:
        state["clear"] = False
        indices = subtract_sent(accumulated, sent)
        if self.masking:
            state["momentum"].view(-1)[indices] = 0

    def flush(self, grad: torch.Tensor, state: dict[str, Any], out: torch.Tensor, scale: float = 1.0) -> None:
        """Everything accumulated into ``out``; v keeps what ``out`` lost and, with masking, u is
        cleared, as `update` with every entry would leave them. While v is known to be zero (after
        an exact flush), u's step alone is sent: the same numbers, three passes fewer."""
        velocity, accumulated = state.get("momentum"), state.get("accumulated")
        if (state.get("clear") and self.clip == 0 and velocity is not None and accumulated is not None
                and velocity.shape == grad.shape):
            if self.nesterov:  # u ← m·(u + g); v (zero) + u + g
                velocity.add_(grad).mul_(self.momentum)
            else:  # u ← m·u + g; v (zero) + u
                velocity.mul_(self.momentum).add_(grad)
            if scale == 1.0 and out.dtype == grad.dtype:  # exact: straight to the wire, v stays zero
                torch.add(velocity, grad, out=out.view(grad.shape)) if self.nesterov else out.copy_(velocity.view(-1))
                if self.masking:
                    velocity.zero_()
                return
            torch.add(velocity, grad, out=accumulated) if self.nesterov else accumulated.copy_(velocity)
        else:
            accumulated = self.accumulate(grad, state)
        state["clear"] = flush_into(accumulated, out, scale)
        if self.masking:
            state["momentum"].zero_()

    def update_uncompressed(self, averaged: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """Momentum on an averaged gradient, as SGD applies it: u ← m·u + g, step u (Nesterov:
        u ← m·(u + g), step u + g). Every rank holds the same average, so the same u."""
        velocity: torch.Tensor | None = state.get("momentum")
        if velocity is None or velocity.shape != averaged.shape or velocity.dtype != averaged.dtype:
            velocity = state["momentum"] = torch.zeros_like(averaged)
        if self.nesterov:
            velocity.add_(averaged).mul_(self.momentum)
            return velocity + averaged
        velocity.mul_(self.momentum).add_(averaged)
        return velocity.clone()
