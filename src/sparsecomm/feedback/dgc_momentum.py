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
momentum would be applied on top; `sparsecomm.check_optimizer` switches such a pipeline to error
feedback, ``residual``, and says so). Local clipping
rescales this tensor's gradient to L2 norm at most ``clip``·``world_size``^(−1/2) before it is
accumulated (the global threshold ``clip`` split evenly over the ranks' gradients); 0 turns it off.
With a lossy value codec, v keeps what quantization lost (error feedback) instead of being zeroed.

Tensors the reducer sends uncompressed (small ones, sparse embedding rows) get the same momentum
after the average over ranks (`update_uncompressed`), as an SGD optimizer's momentum would give
them: the optimizer has none, so without it they would train with none. So do the ``adaptive``
pipeline's dense steps (`flush`, `update_flushed`): while every entry is sent, the ranks' momenta
are one common buffer advanced with the average, as DDP's optimizer would, and the gradient goes
to the all_reduce untouched — no pass over it before the communication starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.feedback.base import FEEDBACKS, Feedback, add_at, held, holds, state_dtype, subtract_sent
from sparsecomm.host_memory import clear_
from sparsecomm.sparse_gradient import SparseGradient


@FEEDBACKS.register("dgc_momentum")
@dataclass(frozen=True)
class DGCMomentum(Feedback):
    applies_momentum = True
    keeps_lost = True
    momentum: float = 0.9
    nesterov: bool = False
    masking: bool = True
    clip: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise SparseCommError("dgc_momentum momentum must be in [0, 1)")
        if self.clip < 0:
            raise SparseCommError("dgc_momentum clip must be >= 0 (0: off)")

    def delay_horizon(self) -> float:
        """A momentum m spreads each gradient over the next 1/(1 − m) steps' updates: an entry held
        back for fewer steps than that arrives within its own momentum's memory."""
        return 1.0 / (1.0 - self.momentum)

    def accumulate(self, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        buffer = momentum_buffer(state, grad, self.momentum, self.nesterov)
        state["averaged"] = False  # the common buffer B, if it was one, is this rank's own b from here on
        grad = self._clipped(grad, state)
        torch.add(grad, buffer, alpha=self.momentum, out=buffer)
        accumulated = held(state, "accumulated", grad)
        if self.nesterov:  # v + g + m·b
            accumulated.add_(grad).add_(buffer, alpha=self.momentum)
        else:
            accumulated.add_(buffer)
        return accumulated

    def _clipped(self, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """``grad`` rescaled to L2 norm at most ``clip``·``world_size``^(−1/2) (local clipping)."""
        if self.clip > 0:
            threshold = self.clip / math.sqrt(state.get("world_size", 1))
            norm = float(torch.linalg.vector_norm(grad))
            if norm > threshold:
                return grad * (threshold / norm)
        return grad

    def update(self, accumulated: torch.Tensor, sent: SparseGradient, state: dict[str, Any]) -> None:
        indices = subtract_sent(accumulated, sent)
        if self.masking:
            state["momentum_buffer"].view(-1)[indices] = 0

    def take_back(self, lost: SparseGradient, state: dict[str, Any]) -> None:
        add_at(state, "accumulated", lost)

    def flush(self, grad: torch.Tensor, state: dict[str, Any], out: torch.Tensor, scale: float = 1.0) -> None:
        """A dense step: the momentum moves to the average, as the optimizer's would. ``out`` gets
        this step's gradient times ``scale``; on the first dense step after sparse ones also what
        this rank still holds, c = (1−m)·v + m·b (Nesterov: m²·b). Once that step's sum is in,
        `update_flushed` empties v and b, and b is from then on the ranks' common buffer B, which
        it advances with the average (a step that fails before, as on a non-finite sum, changes
        nothing: the next dense step sends c again).

        c is what v and b would still have added to the updates of every later step (v once; b
        through its decaying momentum, m·b/(1−m), Nesterov m²·b/(1−m)), scaled so that the common
        momentum adds exactly that much again: nothing is lost, and the sum arrives as a momentum
        impulse rather than spread as the ranks' own buffers would have spread it. After that a
        dense step sends the gradient itself, as DDP does, and fp16 rounds it as PyTorch's fp16
        hook does (not kept: a relative 2⁻¹¹ per step)."""
        buffer = momentum_buffer(state, grad, self.momentum, self.nesterov)
        flat = self._clipped(grad, state).reshape(-1)
        if not state.get("averaged"):  # c joins this step's gradient
            flat = torch.add(flat, state["accumulated"].view(-1), alpha=1.0 - self.momentum).add_(
                buffer.view(-1), alpha=self.momentum ** (2 if self.nesterov else 1))
        if scale != 1.0 or out.dtype != flat.dtype:
            torch.mul(flat, scale, out=out)
        elif out.data_ptr() != flat.data_ptr():
            out.copy_(flat)

    def flush_sends_gradient(self, numel: int, like: torch.Tensor, state: dict[str, Any]) -> bool:
        """Once the momentum is the ranks' common one (after a dense step) and without clipping,
        its buffer where the gradient is, in the dtype it is kept in (not a checkpoint's loaded
        elsewhere or in another dtype)."""
        buffer = state.get("momentum_buffer")
        return (bool(state.get("averaged")) and self.clip == 0 and isinstance(buffer, torch.Tensor)
                and buffer.numel() == numel and buffer.dtype == state_dtype(like.dtype)
                and buffer.device == like.device)

    def flush_reads_only(self, grad: torch.Tensor, state: dict[str, Any], wire_dtype: torch.dtype,
                         scale: float = 1.0) -> bool:
        """Always: it reads v and b (zeros where there are none yet); `update_flushed` empties
        them once the sum is in."""
        return True

    def update_flushed(self, averaged: torch.Tensor, state: dict[str, Any]) -> None:
        """SGD's momentum on the average, in place: B ← m·B + avg, then avg becomes B (Nesterov:
        avg + m·B); with masking (every entry was sent) B is cleared after. The first dense step
        after sparse ones first empties v and b (`flush` sent them)."""
        self.update_flushed_([averaged.view(-1)], [state])

    def update_flushed_(self, averaged: list[torch.Tensor], states: list[dict[str, Any]]) -> None:
        """`update_flushed` for several tensors (flat), in multi-tensor passes."""
        buffers = []
        for state in states:
            buffer = state["momentum_buffer"].view(-1)
            if not state.get("averaged"):
                clear_(state["accumulated"])
                clear_(buffer)
                state["averaged"] = True
            buffers.append(buffer)
        self.momentum_step_(averaged, buffers)
        if self.masking:
            torch._foreach_zero_(buffers)

    def update_uncompressed(self, averaged: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """Momentum on an averaged gradient, as SGD applies it: b ← m·b + g, step b (Nesterov:
        g + m·b). Every rank holds the same average, so the same b."""
        updated = averaged.clone()
        self.update_uncompressed_([updated], [state])
        return updated

    def update_uncompressed_(self, averaged: list[torch.Tensor], states: list[dict[str, Any]]) -> None:
        """`update_uncompressed` for several tensors, in place, in multi-tensor passes."""
        if averaged:
            self.momentum_step_(averaged, [momentum_buffer(state, tensor, self.momentum, self.nesterov,
                                                            accumulator=False)
                                            for tensor, state in zip(averaged, states, strict=True)])

    def momentum_step_(self, averaged: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """SGD's momentum step on each average, in place: b ← m·b + avg, then avg ← b (Nesterov:
        avg + m·b) — one multi-tensor pass per operation, as torch's foreach SGD makes it."""
        torch._foreach_mul_(buffers, self.momentum)
        torch._foreach_add_(buffers, averaged)
        if self.nesterov:
            torch._foreach_add_(averaged, buffers, alpha=self.momentum)
        else:
            torch._foreach_copy_(averaged, buffers)


def momentum_buffer(state: dict[str, Any], like: torch.Tensor, momentum: float, nesterov: bool,
                    accumulator: bool = True) -> torch.Tensor:
    """The state's momentum buffer b (and, with ``accumulator``, its v) in ``like``'s shape, zeros
    where it holds none of ``like``'s size (`held`). A state that holds u as ``"momentum"`` instead is
    converted: plain momentum's u is b, Nesterov's is m·b."""
    saved = state.pop("momentum", None)
    if saved is not None and "momentum_buffer" not in state:
        state["momentum_buffer"] = saved / momentum if nesterov and momentum > 0 else saved
    if accumulator and not holds(state, "momentum_buffer", like):
        state.pop("accumulated", None)
        state["averaged"] = True  # nothing held: zeros serve as the ranks' common buffer as well
    buffer = held(state, "momentum_buffer", like)
    if accumulator:
        held(state, "accumulated", like)
    return buffer
