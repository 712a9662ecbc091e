"""``dense step``: a step the ``adaptive`` controller planned as fp32 or fp16, run as DDP's own hooks
run a bucket — each tensor's feedback flushed into it (in fp16 scaled by 1/P, as DDP's fp16 hook
does), one asynchronous all_reduce posted on the process group itself (no agreement step, no worker
thread), and once the sum is in, what the feedback owns applied to the average (DGC's momentum).
Tensors below ``dense_below`` go as they are, in fp32. A rank whose gradient is non-finite under
``nonfinite="raise"`` sends NaN (or its gradient as it is), so every rank sums to a non-finite total
and raises together. A budget report the planner must hear rides in a tail of the all_reduce
(`sparsecomm.transport.side_numbers`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.adaptive.flat_residual import FlatResidual
from sparsecomm.adaptive.flush import flush, reads_only, update_flushed, withdraw
from sparsecomm.device.status import GOOD, read
from sparsecomm.finite import all_finite, largest_magnitude
from sparsecomm.pipeline import Segment, screen_nonfinite
from sparsecomm.reducer.call import Call, Route, Summed
from sparsecomm.reducer.paths.base import Path, Pending, non_finite_sum
from sparsecomm.reducer.paths.scratch import Scratch
from sparsecomm.transport.collectives import on_wire
from sparsecomm.transport.side_numbers import read_tail, tail_elements, write_tail


@dataclass(frozen=True)
class Wire:
    """What one call of a dense step sends: the tensor all_reduced, its bytes, the gradient's flat
    buffer the sum goes back into, whether the feedback was flushed into it, whether it went in
    fp16 (scaled by 1/P), and — when it carries a report — how many leading elements are gradient
    (the rest is the tail)."""

    tensor: torch.Tensor
    nbytes: int
    home: torch.Tensor
    flushed: bool
    fp16: bool = False
    carrying: int | None = None
    magnitude: torch.Tensor | None = None
    """the largest magnitude sent (0-d, on the gradient's device), read with the sum's check: only
    where the planner must hear it"""
    stepped: bool = False
    """the flush counted this rank's tensors' step"""
    kept: torch.Tensor | None = None
    """a copy of the wire as flushed, where the flush moved residuals into it and a refused step
    must put them back (`withdraw`)"""


class DenseStepPath(Path):
    route = Route.DENSE_STEP

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wires = Scratch()
        """per stream and wire dtype: the buffer it sends when it cannot send the gradient's own
        (fp16, or with a report's tail); not checkpointed"""
        self._residuals: dict[str, FlatResidual] = {}
        """per stream: its parameters' residuals as one buffer (`flush`); the parameters' states
        hold its views, and it is rebuilt from them where they no longer do"""

    def post(self, call: Call, plan: Plan | None, start: float) -> Pending:
        parts, adaptive = self.parts, self.parts.adaptive
        assert adaptive is not None and plan is not None
        # a report travels in a scratch wire, which costs passes over the bucket: only one the planner must hear
        side = adaptive.reports.take(needed_only=True)
        wire = self._wire(call, plan, side)
        submitted = time.perf_counter()
        measuring = adaptive.measuring
        budget_numel = sum(numel for _, numel in call.density_spans()) if wire.flushed else 0
        measuring.submitted(call.tensor.numel(), budget_numel, 0, 0, submitted - start, submitted)
        measuring.issued_dense(submitted)
        # posted on the process group itself, as DDP posts its own: dist.all_reduce's checks cost more.
        # A CUDA tensor goes as it is, on gloo too: gloo stages it through pinned memory on its own
        # stream and thread, where a copy to the wire device here would hold up the backward pass
        posted = wire.tensor if wire.tensor.device.type == "cuda" else on_wire(wire.tensor, parts.wire_device)
        parts.calls.in_order()  # after a sparse gradient's rows on the worker thread
        work = parts.process_group.allreduce([posted])
        return Pending(work.get_future(), submitted, finish_with_step=call.in_step,
                       carries_report=wire.carrying is not None, sent=wire)

    def _wire(self, call: Call, plan: Plan, side: tuple[float, ...] | None) -> Wire:
        """What a dense step sends for ``call``: as it is (fp32) below ``dense_below``, else flushed
        from its feedback, in fp16 on an fp16 step; with ``side`` (a report), followed by its tail.
        Under ``nonfinite="raise"`` the gradient is screened only where its state would need undoing
        (`flush`): a rank's NaN or Inf makes every rank's sum non-finite, and every rank raises."""
        parts = self.parts
        config, adaptive = parts.config, parts.adaptive
        assert adaptive is not None
        tensor, segments = call.tensor, call.segments
        home = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        as_it_is = segments is None and tensor.numel() < config.dense_below
        half = plan.mode == Mode.FP16 and not as_it_is
        # the gradient's own buffer is the wire unless the wire is fp16 or carries a tail
        full = self._buffer(call.key, home, torch.float16 if half else home.dtype) if half or side else None
        sent = full[:home.numel()] if full is not None else home
        scale = 1.0 / config.world_size if half else 1.0  # as DDP's fp16 hook: the sum of P values stays in range
        kept = None
        if as_it_is:  # no feedback: sent as it is
            screened, must_raise = (home, False) if config.screening == "raise" else screen_nonfinite(home,
                                                                                                    config.screening)
            if screened is None:
                sent.zero_()
            elif screened is not sent:
                sent.copy_(screened)
        else:
            # what the flush moves out of the feedback a refused step puts back: a copy, where it moves any
            reads = config.screening == "raise" and reads_only(parts.pipeline, home, segments or (
                Segment(call.key, 0, home.numel()),), sent.dtype, scale)
            sent, must_raise = flush(parts.pipeline, home, call.key, segments, out=sent, scale=scale, sum_checked=True,
                                     buckets=self._residuals, reads=reads)
            kept = sent.clone() if config.screening == "raise" and not reads and not must_raise else None
        wire, carrying = sent, None
        if side is not None:  # then full is the wire buffer
            assert full is not None
            write_tail(full[home.numel():], side, parts.rank)
            wire, carrying = full, home.numel()
        magnitude = None
        if must_raise:
            sent.fill_(math.nan)
        elif sent.numel() and adaptive.report_needed(parts.stats.steps):
            magnitude = largest_magnitude(sent).to(torch.float32) / scale
        return Wire(wire, wire.numel() * wire.element_size(), home, not as_it_is, half, carrying, magnitude,
                    stepped=not as_it_is and not must_raise, kept=kept)

    def _buffer(self, key: str, home: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stream's reusable wire of ``dtype``: room for the gradient and a report's tail."""
        numel = home.numel() + tail_elements(self.parts.config.world_size)
        return self._wires.take((key, dtype), (numel,), dtype, home.device)

    def summed(self, call: Call, pending: Pending, done: torch.futures.Future) -> Summed:
        wire: Wire = pending.sent
        total = done.wait()[0].to(call.tensor.device)  # itself, unless gloo carried a CUDA gradient
        sides = None
        if wire.carrying is not None:
            sides = read_tail(total[wire.carrying:])
            total = total[:wire.carrying]
        return Summed(total, wire.nbytes, owned=True, averaged=wire.fp16,
                      carried_report=wire.carrying is not None, sides=sides)

    def checked(self, call: Call, pending: Pending, summed: Summed) -> torch.Tensor:
        """The sum, raising on every rank where it is non-finite, back in the gradient's buffer
        where the wire was scratch."""
        wire: Wire = pending.sent
        if wire.magnitude is None:
            finite = all_finite(summed.total)
        else:  # one read of the device for both (`status.read`): a finite sum settles the check (`all_finite`)
            summed_finite = torch.isfinite(summed.total.sum(dtype=torch.float32)).to(torch.int64) * GOOD
            status = read(summed_finite, magnitude=wire.magnitude.nan_to_num(nan=0.0, posinf=0.0))
            finite = status.good or all_finite(summed.total)
            if finite and status.magnitude:  # else this rank's was not finite: every rank raises
                adaptive = self.parts.adaptive
                assert adaptive is not None
                adaptive.measuring.saw_magnitude(status.magnitude)
        if not finite:
            raise non_finite_sum(call.key)
        if wire.fp16 or wire.carrying is not None:
            wire.home.copy_(summed.total)
            self._wires.give_back((call.key, wire.tensor.dtype), wire.tensor)
            return wire.home
        return summed.total

    def withdrawn(self, call: Call, pending: Pending) -> None:
        """Every rank raises at this call: where this rank flushed, its tensors' steps and what its
        residuals sent go back (`withdraw`). A refused fp16 step may have overflowed fp16 with
        finite gradients: fp16 waits until a step has measured the largest magnitude again (every
        rank refused the same sum, so every rank's planner does the same)."""
        wire: Wire = pending.sent
        adaptive = self.parts.adaptive
        if wire.fp16 and adaptive is not None:
            adaptive.planner.costs.max_magnitude = math.inf
        self._wires.give_back((call.key, wire.tensor.dtype), wire.tensor)
        if wire.stepped:
            scale = 1.0 / self.parts.config.world_size if wire.fp16 else 1.0
            withdraw(self.parts.pipeline, call.key, call.segments, wire.home.numel(), wire.kept, scale)

    def measured(self, call: Call, pending: Pending, summed: Summed) -> None:
        adaptive = self.parts.adaptive
        assert adaptive is not None
        wire: Wire = pending.sent
        adaptive.measuring.finished(time.perf_counter(), summed.bytes_sent, in_budget=wire.flushed, dense_wire=True,
                                    world_size=self.parts.config.world_size,
                                    min_wire_bytes=adaptive.config.min_wire_bytes)

    def after_average(self, call: Call, pending: Pending, total: torch.Tensor) -> torch.Tensor:
        wire: Wire = pending.sent
        if wire.flushed:  # what the feedback owns follows the average (DGC's momentum)
            update_flushed(self.parts.pipeline, total, call.key, call.segments)
        return self.parts.uncompressed.apply(total, call.key, call.segments, whole_only=wire.flushed)
