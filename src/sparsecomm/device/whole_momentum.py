"""`WholeMomentum`: DGC's momentum for the parameters a bucket sends whole — which the optimizer
does not apply, as `sparsecomm.reducer.uncompressed` says — over one flat buffer of the bucket's
whole entries, stepped in a fixed number of ops whatever the number of parameters. Each
parameter's state (``momentum_buffer``, by name) is a view of its part, so a checkpoint or another
route reads it as its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsecomm.device.layout import BucketLayout
from sparsecomm.feedback.base import Feedback
from sparsecomm.feedback.dgc_momentum import DGCMomentum, momentum_buffer


@dataclass
class WholeMomentum:
    feedback: DGCMomentum
    whole: torch.Tensor
    """the bucket's entries sent whole (`BucketLayout.whole`), in order"""
    buffer: torch.Tensor
    views: list[tuple[dict[str, Any], torch.Tensor]]

    @classmethod
    def of(cls, feedback: Feedback, layout: BucketLayout, states: dict[str, dict[str, Any]]) -> WholeMomentum | None:
        """The momentum of ``layout``'s whole entries from each parameter's state in ``states``
        (zeros where it holds none), each state then a view of the flat buffer; None where the
        feedback applies no momentum or nothing is sent whole."""
        if not isinstance(feedback, DGCMomentum) or layout.whole is None:
            return None
        buffer = torch.zeros(layout.whole.numel(), device=layout.device)
        views, offset = [], 0
        for segment in layout.segments:
            if not segment.whole:
                continue
            state = states.setdefault(segment.key, {})
            view = buffer[offset:offset + segment.numel]
            view.copy_(momentum_buffer(state, view, feedback.momentum, feedback.nesterov, accumulator=False))
            state["momentum_buffer"] = view
            views.append((state, view))
            offset += segment.numel
        return cls(feedback, layout.whole, buffer, views)

    def current(self) -> bool:
        """Whether every parameter's state still is this buffer's view."""
        return all(state.get("momentum_buffer") is view for state, view in self.views)

    def step_(self, averaged: torch.Tensor) -> None:
        """SGD's momentum on the whole entries of ``averaged`` (flat), in place: b ← m·b + g, then
        g ← b (Nesterov: g + m·b) — `DGCMomentum.update_uncompressed`, on them all at once."""
        momentum = self.feedback.momentum
        gradient = averaged[self.whole]
        self.buffer.mul_(momentum).add_(gradient)
        if self.feedback.nesterov:
            gradient.add_(self.buffer, alpha=momentum)
        else:
            gradient = self.buffer
        averaged.index_copy_(0, self.whole, gradient)
