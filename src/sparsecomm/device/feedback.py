"""A feedback's step on a bucket's flat buffers, in two halves: `propose` computes the tensor to
select from and the state the step would leave, touching nothing; `commit` keeps that state once
the sum is known good (and, on a rank whose gradient was not finite, keeps the old one, on the
device, with no host read). The same arithmetic as `sparsecomm.feedback`'s, whose per-parameter
state names the buffers carry, so a checkpoint reads the same either way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.feedback.base import Feedback
from sparsecomm.feedback.dgc_momentum import DGCMomentum
from sparsecomm.feedback.residual import Residual

BUFFERS = {Residual: ("residual",), DGCMomentum: ("momentum_buffer", "accumulated")}
"""each feedback's state, by the names its per-parameter dictionaries give them"""


def buffer_names(feedback: Feedback) -> tuple[str, ...]:
    """The flat buffers ``feedback`` keeps per bucket (none for no feedback)."""
    return BUFFERS.get(type(feedback), ())


@dataclass
class Proposal:
    """A step's tensor to select from, and the state it would leave, by buffer name."""

    accumulated: torch.Tensor
    state: dict[str, torch.Tensor]


def propose(feedback: Feedback, grad: torch.Tensor, buffers: dict[str, torch.Tensor]) -> Proposal:
    """``grad`` (flat) through ``feedback``, into new tensors (what it proposes for entries sent whole
    is never sent, and `commit` clears it)."""
    if isinstance(feedback, Residual):
        accumulated = buffers["residual"] + grad
        return Proposal(accumulated, {"residual": accumulated})
    if isinstance(feedback, DGCMomentum):  # b ← m·b + g;  v ← v + b  (Nesterov: v ← v + g + m·b)
        momentum = torch.add(grad, buffers["momentum_buffer"], alpha=feedback.momentum)
        if feedback.nesterov:
            accumulated = torch.add(buffers["accumulated"], grad).add_(momentum, alpha=feedback.momentum)
        else:
            accumulated = torch.add(buffers["accumulated"], momentum)
        return Proposal(accumulated, {"momentum_buffer": momentum, "accumulated": accumulated})
    return Proposal(grad, {})


def commit(feedback: Feedback, buffers: dict[str, torch.Tensor], proposal: Proposal, sent: torch.Tensor,
           whole: torch.Tensor | None, finite: torch.Tensor | None) -> None:
    """Keep ``proposal`` in ``buffers`` (in place) with the ``sent`` entries delivered — exactly, in
    fp32 — and DGC's momentum masked there; the entries sent ``whole`` hold nothing; where
    ``finite`` (a 0-d bool) is false, keep the old."""
    state = proposal.state
    if not state:
        return
    proposal.accumulated.index_fill_(0, sent, 0.0)
    if isinstance(feedback, DGCMomentum) and feedback.masking:
        state["momentum_buffer"].index_fill_(0, sent, 0.0)
    for name, new in state.items():
        if whole is not None:
            new.index_fill_(0, whole, 0.0)
        old = buffers[name]
        if finite is None:
            old.copy_(new)
        else:
            torch.where(finite, new, old, out=old)
