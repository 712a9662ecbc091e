"""``dgc_momentum``: Deep Gradient Compression's local accumulation with momentum correction (§3.2,
eq. 7; Nesterov: App. B, eq. 10), momentum factor masking (§3.3) and local gradient clipping
(App. C).

    plain:     u ← m·u + g;       v ← v + u
    Nesterov:  u ← m·(u + g);     v ← v + u + g
    send sparse(v);  v ← v − sent;  with masking, u ← 0 where sent

The state holds the buffer b that torch's SGD keeps, b ← m·b + g (its ``momentum_buffer``): plain
momentum's u is b itself, Nesterov's is m·b (then v ← v + g + m·b). The same numbers, and each
update one fused pass (``torch.add`` with ``alpha``) where u's form takes two.

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
        buffer = momentum_buffer(state, grad, self.momentum, self.nesterov)
        if self.clip > 0:
            threshold = self.clip / math.sqrt(state.get("world_size", 1))
            norm = float(torch.linalg.vector_norm(grad))
            if norm > threshold:
                grad = grad * (threshold / norm)
        torch.add(grad, buffer, alpha=self.momentum, out=buffer)
        accumulated = state["accumulated"]
        if self.nesterov:  # v + g + m·b, in the order the flush's shortcut computes g + m·b
            accumulated.add_(grad).add_(buffer, alpha=self.momentum)
        else:
            accumulated.add_(buffer)
        return accumulated

    def update(self, accumulated: torch.Tensor, sent: SparseGradient, state: dict[str, Any]) -> None:
        state["clear"] = False
        indices = subtract_sent(accumulated, sent)
        if self.masking:
            state["momentum_buffer"].view(-1)[indices] = 0

    def flush(self, grad: torch.Tensor, state: dict[str, Any], out: torch.Tensor, scale: float = 1.0) -> None:
        """Everything accumulated into ``out``; v keeps what ``out`` lost and, with masking, b is
        cleared, as `update` with every entry would leave them. While v is known to be zero (after
        an exact flush), this step's part alone is sent: b ← m·b + g and g + m·b (plain: b), two
        passes where accumulating takes three and the flush two more."""
        if state.get("clear") and self.clip == 0:
            buffer = momentum_buffer(state, grad, self.momentum, self.nesterov)
            accumulated = state["accumulated"]
            torch.add(grad, buffer, alpha=self.momentum, out=buffer)
            if scale == 1.0 and out.dtype == grad.dtype:  # exact: straight to the wire, v stays zero
                wire = out.view(grad.shape)
                torch.add(grad, buffer, alpha=self.momentum, out=wire) if self.nesterov else wire.copy_(buffer)
                if self.masking:
                    buffer.zero_()
                return
            if self.nesterov:
                torch.add(grad, buffer, alpha=self.momentum, out=accumulated)
            else:
                accumulated.copy_(buffer)
        else:
            accumulated = self.accumulate(grad, state)
        state["clear"] = flush_into(accumulated, out, scale)
        if self.masking:
            state["momentum_buffer"].zero_()

    def update_uncompressed(self, averaged: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """Momentum on an averaged gradient, as SGD applies it: b ← m·b + g, step b (Nesterov:
        g + m·b). Every rank holds the same average, so the same b."""
        buffer = momentum_buffer(state, averaged, self.momentum, self.nesterov, accumulator=False)
        torch.add(averaged, buffer, alpha=self.momentum, out=buffer)
        return torch.add(averaged, buffer, alpha=self.momentum) if self.nesterov else buffer.clone()


def momentum_buffer(state: dict[str, Any], like: torch.Tensor, momentum: float, nesterov: bool,
                    accumulator: bool = True) -> torch.Tensor:
    """The state's momentum buffer b (and, with ``accumulator``, its v), zeros of ``like``'s shape
    and dtype when missing or of another shape. A state saved before the buffer form holds u as
    ``"momentum"``: plain momentum's u is b, Nesterov's is m·b."""
    saved = state.pop("momentum", None)
    if saved is not None and "momentum_buffer" not in state:
        state["momentum_buffer"] = saved / momentum if nesterov and momentum > 0 else saved
    buffer: torch.Tensor | None = state.get("momentum_buffer")
    if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
        buffer = state["momentum_buffer"] = torch.zeros_like(like)
    accumulated = state.get("accumulated")
    if accumulator and (accumulated is None or accumulated.shape != like.shape or accumulated.dtype != like.dtype):
        state["accumulated"] = torch.zeros_like(like)
    return buffer
