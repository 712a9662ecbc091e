"""What the device route keeps for the parameters a bucket sends whole, each over one flat buffer of
the bucket's whole entries and stepped in a fixed number of ops whatever the number of parameters:
`WholeMomentum`, DGC's momentum (which the optimizer does not apply to them, as
`sparsecomm.reducer.uncompressed` says), and `WholeError`, what a lossy value codec rounded off
them (the host path's `TensorState.codec_error`). Each parameter's state is a view of its part,
under the host path's names, so a checkpoint or another route reads it as its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsecomm.device import values as device_values
from sparsecomm.device.layout import BucketLayout
from sparsecomm.encode.base import ValueCodec
from sparsecomm.feedback.base import Feedback
from sparsecomm.feedback.dgc_momentum import DGCMomentum, momentum_buffer
from sparsecomm.pipeline import Segment, TensorState


def whole_views(layout: BucketLayout, buffer: torch.Tensor) -> list[tuple[Segment, torch.Tensor]]:
    """Each segment sent whole, with its part of ``buffer`` (one entry per whole entry, in order)."""
    views, offset = [], 0
    for segment in layout.segments:
        if segment.whole:
            views.append((segment, buffer[offset:offset + segment.numel]))
            offset += segment.numel
    return views


@dataclass
class WholeMomentum:
    feedback: DGCMomentum
    whole: torch.Tensor
    """the bucket's entries sent whole (`BucketLayout.whole`), in order"""
    buffer: torch.Tensor
    views: list[tuple[str, dict[str, Any], torch.Tensor]]
    """each parameter's name, state and view"""

    @classmethod
    def of(cls, feedback: Feedback, layout: BucketLayout, states: dict[str, dict[str, Any]]) -> WholeMomentum | None:
        """The momentum of ``layout``'s whole entries from each parameter's state in ``states``
        (zeros where it holds none), each state then a view of the flat buffer; None where the
        feedback applies no momentum or nothing is sent whole."""
        if not isinstance(feedback, DGCMomentum) or layout.whole is None:
            return None
        buffer = torch.zeros(layout.whole.numel(), device=layout.device)
        views = []
        for segment, view in whole_views(layout, buffer):
            state = states.setdefault(segment.key, {})
            view.copy_(momentum_buffer(state, view, feedback.momentum, feedback.nesterov, accumulator=False))
            state["momentum_buffer"] = view
            views.append((segment.key, state, view))
        return cls(feedback, layout.whole, buffer, views)

    def current(self, states: dict[str, dict[str, Any]]) -> bool:
        """Whether every parameter's state in ``states`` still is the one this buffer was built on,
        holding its view."""
        return all(states.get(key) is state and state.get("momentum_buffer") is view for key, state, view in self.views)

    def step_(self, averaged: torch.Tensor) -> None:
        """SGD's momentum on the whole entries of ``averaged`` (flat), in place: b ← m·b + g, then
        g ← b (Nesterov: g + m·b) — `DGCMomentum.update_uncompressed`, on them all at once."""
        gradient = averaged[self.whole]
        self.feedback.momentum_step_([gradient], [self.buffer])
        averaged.index_copy_(0, self.whole, gradient)


@dataclass
class WholeError:
    """What the value codec rounded off the entries sent whole, added to them at the next step: a
    call proposes the new error into the spare buffer, kept (the two swap, no copy) once the sum is
    known good."""

    whole: torch.Tensor
    held: torch.Tensor
    spare: torch.Tensor
    views: tuple[list[tuple[TensorState, torch.Tensor]], list[tuple[TensorState, torch.Tensor]]]
    """each parameter's view of ``held`` and of ``spare``"""

    @classmethod
    def of(cls, codec: ValueCodec, layout: BucketLayout, states: list[TensorState]) -> WholeError | None:
        """The error of ``layout``'s whole entries from each parameter's state (``states``, one per
        segment; zeros where it holds none), each state then a view of the flat buffer; None where
        the codec is exact or nothing is sent whole."""
        if device_values.lossless(codec) or layout.whole is None:
            return None
        held, spare = (torch.zeros(layout.whole.numel(), device=layout.device) for _ in range(2))
        views: tuple[list[tuple[TensorState, torch.Tensor]], list[tuple[TensorState, torch.Tensor]]] = ([], [])
        by_key = {segment.key: state for segment, state in zip(layout.segments, states, strict=True)}
        for (segment, view), (_, spare_view) in zip(whole_views(layout, held), whole_views(layout, spare), strict=True):
            state = by_key[segment.key]
            if state.codec_error is not None and state.codec_error.numel() == segment.numel:
                view.copy_(state.codec_error.reshape(-1))
            state.codec_error = view
            views[0].append((state, view))
            views[1].append((state, spare_view))
        return cls(layout.whole, held, spare, views)

    def reclaim(self) -> None:
        """Each parameter's state holds its view again, with the error the state holds: another
        route replaces it (a dense step sends it along and leaves none, zeroed here; a step on the
        codecs makes its own, copied in here). A bucket then outlives the other routes' steps."""
        for state, view in self.views[0]:
            error = state.codec_error
            if error is view:
                continue
            if error is None or error.numel() != view.numel():
                view.zero_()
            else:
                view.copy_(error.reshape(-1))
            state.codec_error = view

    def sent(self, gradient: torch.Tensor) -> torch.Tensor:
        """The whole entries of ``gradient`` (flat) with what the codec rounded off them before, in
        the dtype that error is kept in (a half-precision gradient's entries would round it away)."""
        return gradient[self.whole].to(self.held.dtype).add_(self.held)

    def propose(self, sent: torch.Tensor, delivered: torch.Tensor) -> None:
        """What the receivers miss of ``sent``, into the spare buffer."""
        torch.sub(sent, delivered, out=self.spare)

    def keep(self) -> None:
        """The proposed error becomes the state."""
        self.held, self.spare = self.spare, self.held
        self.views = self.views[1], self.views[0]
        for state, view in self.views[0]:
            state.codec_error = view
