"""A feedback's step on a bucket's flat buffers, in two halves: `propose` computes the tensor to
select from and the state the step would leave into a spare set of buffers, touching nothing
else; `commit` settles what was sent in it, and the caller swaps it in once the sum is known good
and this rank's gradient was finite (both known from the call's one host read; a call every
rank refused keeps a finite rank's proposal with nothing sent; otherwise the old state stays, and
the spare is overwritten next time). The same arithmetic as
`sparsecomm.feedback`'s, whose per-parameter state names the buffers carry, so a checkpoint reads
the same either way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsecomm.feedback.base import Feedback
from sparsecomm.feedback.dgc_momentum import DGCMomentum
from sparsecomm.feedback.residual import Residual

BUFFERS = {Residual: ("residual",), DGCMomentum: ("momentum_buffer", "accumulated")}
"""each feedback's state, by the names its per-parameter dictionaries give them"""


KEPT_FLAGS: dict[type, dict[str, Any]] = {Residual: {"clear": False}}
"""what each feedback's per-parameter state says once a sparse step is kept, as its own `update`
says it: `Residual`'s residual holds what was not sent, so a dense step's flush must send it"""


def buffer_names(feedback: Feedback) -> tuple[str, ...]:
    """The flat buffers ``feedback`` keeps per bucket (none for no feedback)."""
    return BUFFERS.get(type(feedback), ())


def kept_flags(feedback: Feedback) -> dict[str, Any]:
    """The flags ``feedback``'s per-parameter state takes once a proposal is kept (`KEPT_FLAGS`)."""
    return KEPT_FLAGS.get(type(feedback), {})


@dataclass
class Proposal:
    """A step's tensor to select from, and the state it would leave, by buffer name."""

    accumulated: torch.Tensor
    state: dict[str, torch.Tensor]


def propose(feedback: Feedback, grad: torch.Tensor, current: dict[str, torch.Tensor],
            spare: dict[str, torch.Tensor]) -> Proposal:
    """``grad`` (flat) through ``feedback``: the state it reads is ``current``'s, the state it would
    leave goes into ``spare``, touching nothing else. Each buffer holds one entry more than
    ``grad``, the padding a selection's unused slots name, which stays zero (what the proposal holds
    for entries sent whole is never sent, and `commit` clears it)."""
    if isinstance(feedback, Residual):
        accumulated = spare["residual"]
        torch.add(current["residual"][:-1], grad, out=accumulated[:-1])
        return Proposal(accumulated, {"residual": accumulated})
    if isinstance(feedback, DGCMomentum):  # b ← m·b + g;  v ← v + b  (Nesterov: v ← v + g + m·b)
        momentum, accumulated = spare["momentum_buffer"], spare["accumulated"]
        torch.add(grad, current["momentum_buffer"][:-1], alpha=feedback.momentum, out=momentum[:-1])
        if feedback.nesterov:
            torch.add(current["accumulated"][:-1], grad, out=accumulated[:-1]).add_(momentum[:-1],
                                                                                    alpha=feedback.momentum)
        else:
            torch.add(current["accumulated"][:-1], momentum[:-1], out=accumulated[:-1])
        return Proposal(accumulated, {"momentum_buffer": momentum, "accumulated": accumulated})
    accumulated = torch.empty(grad.numel() + 1, dtype=grad.dtype, device=grad.device)
    accumulated[:-1] = grad
    accumulated[-1] = 0.0
    return Proposal(accumulated, {})


def commit(feedback: Feedback, proposal: Proposal, sent: torch.Tensor, whole: torch.Tensor | None,
           delivered: torch.Tensor | None = None) -> None:
    """Make ``proposal`` the state to keep, in place: the ``sent`` entries delivered — as
    ``delivered`` says (what the receivers decoded), or exactly where it is None — and DGC's
    momentum masked there; the entries sent ``whole`` hold nothing. The caller keeps it (in place
    of the current state) once the sum is known good and this rank's gradient was finite."""
    state = proposal.state
    if not state:
        return
    if delivered is None:
        proposal.accumulated.index_fill_(0, sent, 0.0)
    else:  # what a lossy value codec rounded off stays, and goes with a later step
        proposal.accumulated.index_add_(0, sent, delivered.to(proposal.accumulated.dtype), alpha=-1.0)
    if isinstance(feedback, DGCMomentum) and feedback.masking:
        state["momentum_buffer"].index_fill_(0, sent, 0.0)
    if whole is not None:
        for new in state.values():
            new.index_fill_(0, whole, 0.0)
