"""A dense step's local stage: each tensor's gradient plus what its feedback holds, sent whole
(`flush`), and after the all_reduce what the feedback owns moved to the average (`update_flushed`).
The state is the pipeline's (`Pipeline.states`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsecomm.adaptive.flat_residual import FlatResidual
from sparsecomm.feedback.base import held
from sparsecomm.feedback.residual import Residual
from sparsecomm.pipeline import Pipeline, Segment, StepReport, TensorState, screen_nonfinite, with_codec_error


def flush(pipeline: Pipeline, grad: torch.Tensor, key: str = "", segments: Sequence[Segment] | None = None,
          out: torch.Tensor | None = None, scale: float = 1.0, sum_checked: bool = False,
          buckets: dict[str, FlatResidual] | None = None, reads: bool | None = None) -> tuple[torch.Tensor, bool]:
    """A dense step: each tensor's gradient plus what its feedback sends with it (`Feedback.flush`),
    to be sent whole, times ``scale``, in ``out``'s dtype (a new tensor of ``grad``'s without
    ``out``, which may be ``grad`` itself); after the all_reduce, `update_flushed`. A narrower
    ``out`` (fp16) rounds what is sent; error feedback keeps what the rounding lost (tensors
    sent whole send what a lossy codec took from them before, and keep no rounding, as DDP's
    fp16 hook keeps none). Returns (the flat wire tensor, whether
    every rank must raise). Non-finite input under ``"raise"`` leaves the state untouched; under
    ``"skip"`` the feedback flushes as with a zero gradient (DGC's momentum must move to the
    average on every rank alike). ``sum_checked``: the caller raises on every rank when the sum
    is non-finite; under ``"raise"``, where no tensor's flush changes its state
    (`Feedback.flush_reads_only`), the gradient then goes unscreened — a NaN sent makes every
    rank's sum NaN — saving a pass over it (and on a GPU a wait for it) before the all_reduce;
    the feedback is then untouched and each tensor's step counted on every rank alike.
    A bucket of several tensors flushes in a few passes over the whole of it, not a few per
    tensor, where every tensor's feedback sends the gradient alone (`Feedback.flush_sends_gradient`:
    DGC's momentum once it is common) — one pass — or under ``residual`` feedback with ``buckets``,
    the caller's `FlatResidual` per bucket key, which this keeps. ``reads``: `reads_only` of these
    arguments, where the caller has asked it already."""
    flat = grad.detach().reshape(-1)
    segments = segments or (Segment(key, 0, flat.numel()),)
    wire = out.view(-1) if out is not None else torch.empty_like(flat)
    screened: torch.Tensor | None = flat
    must_raise = False
    left_to_sum = sum_checked and pipeline.nonfinite == "raise"
    if reads is None and left_to_sum:
        reads = reads_only(pipeline, flat, segments, wire.dtype, scale)
    if not (left_to_sum and reads):
        screened, must_raise = screen_nonfinite(flat, pipeline.nonfinite)
    if must_raise:
        for segment in segments:
            pipeline.states.setdefault(segment.key, TensorState()).last = StepReport(0, None, segment.numel, 0, True)
        return wire.zero_(), True
    skipped = screened is None
    screened = torch.zeros_like(flat) if screened is None else screened
    states = [pipeline.states.setdefault(segment.key, TensorState()) for segment in segments]
    for state in states:
        state.feedback["world_size"] = pipeline.world_size
    if len(segments) > 1 and _sends_gradient(pipeline, segments, states, screened):
        if scale != 1.0 or wire.dtype != screened.dtype:
            torch.mul(screened, scale, out=wire)  # fp16 rounds it, as DDP's hook
        elif wire.data_ptr() != screened.data_ptr():
            wire.copy_(screened)
    elif buckets is not None and len(segments) > 1 and isinstance(pipeline.spec.feedback, Residual):
        _flush_bucket(states, segments, screened, wire, scale, buckets, key)
    else:
        for segment, state in zip(segments, states, strict=True):
            _flush_one(pipeline, segment, state, screened, wire, scale)
    for segment, state in zip(segments, states, strict=True):
        state.step += 1
        state.last = StepReport(0 if skipped else segment.numel, None if skipped else segment.numel,
                                segment.numel, 0, skipped)
    return wire, False


def _flush_one(pipeline: Pipeline, segment: Segment, state: TensorState, screened: torch.Tensor, wire: torch.Tensor,
               scale: float) -> None:
    """One tensor's share of `flush`."""
    piece = screened[segment.start:segment.start + segment.numel]
    part = wire[segment.start:segment.start + segment.numel]
    if not segment.whole:
        pipeline.spec.feedback.flush(piece, state.feedback, part, scale)
    elif state.codec_error is not None or scale != 1.0 or part.dtype != piece.dtype:
        torch.mul(with_codec_error(piece, state), scale, out=part)  # fp16 rounds it, as DDP's hook
        state.codec_error = None
    elif part.data_ptr() != piece.data_ptr():
        part.copy_(piece)


def _sends_gradient(pipeline: Pipeline, segments: Sequence[Segment], states: list[TensorState],
                    screened: torch.Tensor) -> bool:
    """Whether each tensor's flush would send its gradient alone (`Feedback.flush_sends_gradient`;
    a tensor sent whole: without a codec's error to add)."""
    feedback = pipeline.spec.feedback
    for segment, state in zip(segments, states, strict=True):
        if segment.whole:
            if state.codec_error is not None:
                return False
        elif not feedback.flush_sends_gradient(segment.numel, screened, state.feedback):
            return False
    return True


def _flush_bucket(states: list[TensorState], segments: Sequence[Segment], screened: torch.Tensor,
                  wire: torch.Tensor, scale: float, buckets: dict[str, FlatResidual], key: str) -> None:
    """`flush` of a bucket's tensors under ``residual`` feedback, on their residuals as one buffer:
    what a lossy codec took from the tensors sent whole goes into their (empty) entries of it first."""
    bucket = buckets[key] = FlatResidual.of(states, segments, screened, buckets.get(key))
    clear = all(state.feedback.get("clear") for state, segment in zip(states, segments, strict=True)
                if not segment.whole)
    for segment, state in zip(segments, states, strict=True):
        if segment.whole and state.codec_error is not None:
            bucket.buffer[segment.start:segment.start + segment.numel].copy_(state.codec_error.reshape(-1))
            state.codec_error, clear = None, False
    clear = bucket.flush(screened, wire, scale, clear)
    for state, segment in zip(states, segments, strict=True):
        if not segment.whole:
            state.feedback["clear"] = clear


def reads_only(pipeline: Pipeline, flat: torch.Tensor, segments: Sequence[Segment], wire_dtype: torch.dtype,
               scale: float) -> bool:
    """Whether `flush` changes no tensor's state: each feedback's flush only reads it, and no
    tensor sent whole has a codec's error to send along."""
    for segment in segments:
        state = pipeline.states.get(segment.key) or TensorState()
        if segment.whole:
            if state.codec_error is not None:
                return False
        elif not pipeline.spec.feedback.flush_reads_only(flat[segment.start:segment.start + segment.numel],
                                                     state.feedback, wire_dtype, scale):
            return False
    return True


def withdraw(pipeline: Pipeline, key: str, segments: Sequence[Segment] | None, numel: int,
             sent: torch.Tensor | None, scale: float = 1.0) -> None:
    """A flushed call every rank refused (a rank's gradient was non-finite): each tensor's step
    count goes back, so the ranks stay at one step, and where the flush moved residuals into the
    wire, ``sent`` (a copy of the wire as flushed) goes back into them: a residual then holds
    what it held before and this step's gradient, as the codecs' route keeps what it selected —
    but for an entry the wire could not hold (beyond fp16's range: Inf), which is lost, so that no
    later step sends it again. A flush that only read its state (DGC's momentum) has nothing else
    to undo."""
    for segment in segments or (Segment(key, 0, numel),):
        state = pipeline.states[segment.key]
        state.step -= 1
        if sent is None or segment.whole:
            continue
        piece = sent[segment.start:segment.start + segment.numel]
        residual = held(state.feedback, "residual", piece).view(-1).add_(piece, alpha=1.0 / scale)
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # what rounding kept of an Inf: ±Inf, or NaN
        state.feedback["clear"] = False


def update_flushed(pipeline: Pipeline, averaged: torch.Tensor, key: str = "",
                   segments: Sequence[Segment] | None = None) -> None:
    """After a dense step's all_reduce: each flushed tensor's `Feedback.update_flushed` on its
    slice of ``averaged`` (flat, in place; every rank passes the same)."""
    flat = averaged.view(-1)
    flushed = [segment for segment in segments or (Segment(key, 0, flat.numel()),) if not segment.whole]
    if not flushed:  # every tensor went whole: no feedback to update
        return
    pipeline.spec.feedback.update_flushed_([flat[s.start:s.start + s.numel] for s in flushed],
                                       [pipeline.states[s.key].feedback for s in flushed])
