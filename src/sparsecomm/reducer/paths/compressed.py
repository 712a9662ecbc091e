"""``compressed``: the pipeline's local stages — feedback, sparsifier, codecs, each parameter of a
bucket with its own state — and the spec's transport. A rank whose codec cannot carry its values
(beyond fp16's range) sends nothing and every rank raises with its reason."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from sparsecomm.adaptive.config import Plan
from sparsecomm.encode.base import ValueCodec
from sparsecomm.errors import SparseCommError
from sparsecomm.finite import largest_magnitude
from sparsecomm.pipeline import Segment, TensorState
from sparsecomm.reducer.call import Call, Route, Summed
from sparsecomm.reducer.paths.base import Pending, Sent, TransportPath, refused
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import Sparsifier
from sparsecomm.transport.base import Transport
from sparsecomm.transport.request import Request


class CompressedPath(TransportPath):
    route = Route.COMPRESSED

    def contribution(self, call: Call, request: Request,
                     plan: Plan | None) -> tuple[Transport, SparseGradient, Request]:
        pipeline, adaptive = self.parts.pipeline, self.parts.adaptive
        transport = self.parts.config.spec.transport
        if adaptive is not None:  # this step's sample of the gradient, where it takes one
            adaptive.planner.sample_energy(call.tensor.reshape(-1), call.density_spans())
        flat = call.flat
        try:
            output = pipeline.step(flat, call.key, segments=call.segments,
                                   density=plan.density if plan is not None else None)
        except SparseCommError as error:  # a codec that cannot carry these values (fp16's range): all raise
            nothing = SparseGradient(torch.zeros(0, dtype=torch.int64, device=flat.device),
                                     torch.zeros(0, dtype=flat.dtype, device=flat.device), flat.shape)
            return transport, nothing, refused(request, error)
        return transport, output.selection, replace(request, nonfinite=output.nonfinite, payload=output.payload,
                                                    payload_is_contribution=True,
                                                    keeps_lost=pipeline.spec.feedback.keeps_lost)

    def _sparsifier(self, plan: Plan | None) -> Sparsifier:
        pipeline = self.parts.pipeline
        return pipeline.spec.sparsifier if plan is None else pipeline.at_density(plan.density)

    def budget_counts(self, call: Call, plan: Plan | None) -> tuple[int, int, int]:
        pipeline = self.parts.pipeline
        spans = call.density_spans()
        planned = 0
        if plan is not None:
            at_density = pipeline.at_density(plan.density)
            planned = sum(at_density.target_count(numel) for _, numel in spans)
        whole = [s for s in call.segments or () if s.whole]
        whole_nnz = sum(last.selected for s in whole if (last := pipeline.states[s.key].last) is not None)
        return sum(numel for _, numel in spans), planned, whole_nnz

    def expected_entries(self, call: Call, plan: Plan | None) -> int | None:
        """From sizes, the sparsifier's target and the agreed density: a parameter sent whole or a
        sparsifier with no target counts every entry."""
        sparsifier = self._sparsifier(plan)
        sizes = [(s.numel, s.whole) for s in call.segments] if call.segments else [(call.tensor.numel(), False)]
        targets = [None if whole else sparsifier.target_count(numel) for numel, whole in sizes]
        return sum(numel if target is None else target for (numel, _), target in zip(sizes, targets, strict=True))

    def measured(self, call: Call, pending: Pending, summed: Summed) -> None:
        adaptive = self.parts.adaptive
        assert adaptive is not None
        contribution = pending.sent.contribution
        measuring = adaptive.measuring
        measuring.finished(time.perf_counter(), summed.bytes_sent, payload_nnz=contribution.nnz)
        if contribution.nnz and adaptive.report_needed(self.parts.stats.steps):
            measuring.saw_magnitude(float(largest_magnitude(contribution.values)))

    def take_back(self, call: Call, lost: SparseGradient) -> None:
        self.parts.pipeline.take_back(lost, call.key, call.segments)

    def withdrawn(self, call: Call, pending: Pending) -> None:
        """What this rank selected goes back into its feedback, to go out with a later step, and its
        tensors' step counts go back, so the ranks stay at one step. A rank whose codec refused its
        values never counted the step, and its feedback holds the gradient but for what the codec
        cannot carry (`drop_beyond`); one whose gradient was non-finite never took the step: its
        feedback takes one of zeros, as under ``nonfinite="skip"``, so that every rank's state is
        of one kind (DGC's momentum: each rank's own from this step on, where a dense step had made
        it common)."""
        sent: Sent = pending.sent
        pipeline = self.parts.pipeline
        segments = call.segments or (Segment(call.key, 0, call.flat.numel()),)
        if not sent.stepped:
            for segment in segments:
                state = pipeline.states.setdefault(segment.key, TensorState())
                if sent.sat_out:
                    pipeline.idle(segment, state, call.flat, counted=False)
                else:
                    drop_beyond(pipeline.spec.value_codec, state)
            return
        assert isinstance(sent.contribution, SparseGradient)
        pipeline.take_back(sent.contribution.sorted(), call.key, call.segments)
        for segment in segments:
            pipeline.states[segment.key].step -= 1

    def after_average(self, call: Call, pending: Pending, total: torch.Tensor) -> torch.Tensor:
        return self.parts.uncompressed.apply(total, call.key, call.segments, whole_only=True)


def drop_beyond(codec: ValueCodec, state: TensorState) -> None:
    """Zero what a tensor's feedback holds beyond the largest value ``codec`` carries
    (`ValueCodec.largest`): a value the codec refused, which every later step would send and the
    codec refuse again. That value is lost."""
    bound = codec.largest()
    if math.isinf(bound):
        return
    held = [value for value in state.feedback.values() if isinstance(value, torch.Tensor) and value.is_floating_point()]
    for value in [*held, *([state.codec_error] if state.codec_error is not None else [])]:
        value.masked_fill_(value.abs() > bound, 0.0)
