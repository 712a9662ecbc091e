"""`FlatResidual`: a bucket's residuals (`sparsecomm.feedback.residual`) as one flat buffer, each
sparsified parameter's state holding a view of its slice, so that a dense step flushes the whole
bucket in a few passes instead of a few per parameter (`sparsecomm.adaptive.flush.flush`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsecomm.feedback.base import hold_in, state_dtype
from sparsecomm.pipeline import Segment, TensorState

NAME = "residual"
"""the feedback state's buffer, as `Residual` names it"""


@dataclass(frozen=True)
class FlatResidual:
    """One bucket's residuals in ``buffer`` (the bucket's numel, at least), each sparsified
    parameter's state holding ``views[i]``; the entries of parameters sent whole (``whole``, their
    flat positions) hold nothing. The buffer may be the device route's, which keeps the same
    views: either route finds them in place."""

    buffer: torch.Tensor
    views: tuple[torch.Tensor, ...]
    whole: torch.Tensor | None

    @classmethod
    def of(cls, states: Sequence[TensorState], segments: Sequence[Segment], like: torch.Tensor,
           kept: FlatResidual | None = None) -> FlatResidual:
        """``kept`` where the sparsified segments' ``states`` still hold its views, else their
        residuals as one buffer on ``like``'s device, in the dtype a feedback keeps ``like``'s in
        (`state_dtype`): the one their views share where they share one at their segments' places
        (the device route's), or a new one their residuals are copied into (zeros where a state
        holds none) and whose views they then hold."""
        sparsified = [(state, segment) for state, segment in zip(states, segments, strict=True) if not segment.whole]
        if kept is not None and len(kept.views) == len(sparsified) and all(
                state.feedback.get(NAME) is view for (state, _), view in zip(sparsified, kept.views, strict=True)):
            return kept
        whole = [torch.arange(s.start, s.start + s.numel, device=like.device) for s in segments if s.whole]
        whole_index = torch.cat(whole) if whole else None
        shared = _shared(sparsified, like)
        if shared is not None:
            return cls(shared, tuple(state.feedback[NAME] for state, _ in sparsified), whole_index)
        buffer = torch.zeros(like.numel(), dtype=state_dtype(like.dtype), device=like.device)
        views = hold_in(buffer, NAME, [(state.feedback, segment.start, segment.numel) for state, segment in sparsified])
        return cls(buffer, tuple(views), whole_index)

    def flush(self, grad: torch.Tensor, out: torch.Tensor, scale: float, clear: bool) -> bool:
        """grad + the residuals, times ``scale``, into ``out`` (flat, the bucket's size; a narrower
        dtype rounds it; it may be ``grad`` itself), the residuals keeping what ``out`` lost and
        the entries sent whole nothing (as DDP's fp16 hook keeps no rounding). ``clear``: the
        residuals are known to be zero, and are not read. Returns whether they are zero now (the
        same dtype, no scaling)."""
        residual = self.buffer[:grad.numel()]
        if clear:
            if scale == 1.0 and out.dtype == grad.dtype:
                if out.data_ptr() != grad.data_ptr():
                    out.copy_(grad)
                return True
            torch.mul(grad, scale, out=out)  # rounded to out's dtype as it is written
            torch.sub(grad, out, alpha=1.0 / scale, out=residual)
        else:
            if scale == 1.0 and out.dtype == residual.dtype:  # (a half-precision gradient's residual is fp32)
                torch.add(residual, grad, out=out)
                residual.zero_()
                return True
            residual.add_(grad)
            torch.mul(residual, scale, out=out)
            residual.sub_(out, alpha=1.0 / scale)
        if self.whole is not None:
            residual.index_fill_(0, self.whole, 0.0)
        return False


def _shared(sparsified: list[tuple[TensorState, Segment]], like: torch.Tensor) -> torch.Tensor | None:
    """The buffer every sparsified state's residual is a view of, at its segment's place, where
    they all share one in the dtype a feedback keeps ``like``'s in, on its device, that covers the
    bucket (None otherwise)."""
    if not sparsified:
        return None
    first = sparsified[0][0].feedback.get(NAME)
    base = first._base if isinstance(first, torch.Tensor) else None
    if (base is None or base.dtype != state_dtype(like.dtype) or base.device != like.device or base.dim() != 1
            or base.numel() < like.numel()):
        return None
    for state, segment in sparsified:
        view = state.feedback.get(NAME)
        if (not isinstance(view, torch.Tensor) or view._base is not base or view.numel() != segment.numel
                or view.storage_offset() - base.storage_offset() != segment.start or not view.is_contiguous()):
            return None
    return base
