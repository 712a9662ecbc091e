"""``device``: the compressed route of a pipeline whose every stage has a device form
(`sparsecomm.device.support`): one pass over the bucket, in fixed sizes — the feedback proposes,
a capacity's worth of entries is selected, one fixed-size buffer is packed and all-gathered, the
ranks' buffers are summed — and the one host read of the call is the sum's check. The feedback's
state is committed once the sum is known good; where every rank raises, a rank whose gradient
was finite keeps what it proposed, nothing sent.

Each bucket's feedback lives in flat buffers; each parameter's state in the pipeline is a view of
its segment, under the names the host path uses, so a checkpoint is the same either way and
follows a parameter into whatever bucket DDP puts it. A rank whose gradient is non-finite sends
NaN under ``nonfinite="raise"`` (every rank's sum is then non-finite and every rank raises) and
zeros under ``"skip"``, its feedback taking a zero gradient's step; ``"zero"`` replaces those
entries by 0."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.device import values as device_values
from sparsecomm.device.feedback import Proposal, buffer_names, commit, kept_flags, propose
from sparsecomm.device.layout import BucketLayout
from sparsecomm.device.selection import select, select_shared
from sparsecomm.device.shares import SHARE_STEPS, rounded
from sparsecomm.device.status import GOOD, OWN_FINITE, read
from sparsecomm.device.whole import WholeError, WholeMomentum
from sparsecomm.device.wire import WireFormat, stamped
from sparsecomm.encode.index.packed import PackedIndices
from sparsecomm.errors import SparseCommError
from sparsecomm.feedback.base import hold_in, state_dtype
from sparsecomm.feedback.dgc_momentum import DGCMomentum
from sparsecomm.finite import largest_magnitude
from sparsecomm.pipeline import Segment, TensorState, key_hash, seeded_generator
from sparsecomm.reducer.call import Call, Route, Summed
from sparsecomm.reducer.paths.base import Path, Pending, non_finite_sum
from sparsecomm.sparsify.adaptive import Adaptive
from sparsecomm.sparsify.base import CountedSparsifier
from sparsecomm.spec import PipelineSpec
from sparsecomm.transport.collectives import all_gather_single, on_wire


@dataclass
class BufferSet:
    """A feedback's flat buffers for one bucket (one entry more than the bucket, the padding, zero),
    and each sparsified parameter's view of them, by state and name."""

    buffers: dict[str, torch.Tensor]
    views: list[tuple[TensorState, str, torch.Tensor]]

    def like(self) -> BufferSet:
        """A set of zeros of the same shapes, with its own views."""
        buffers = {name: torch.zeros_like(buffer) for name, buffer in self.buffers.items()}
        views = [(state, name, buffers[name][offset(view, self.buffers[name]):][:view.numel()])
                 for state, name, view in self.views]
        return BufferSet(buffers, views)


def offset(view: torch.Tensor, buffer: torch.Tensor) -> int:
    return int(view.storage_offset() - buffer.storage_offset())


FORMS_KEPT = 2 * SHARE_STEPS
"""a bucket's buffer formats kept: as many capacities as two densities' shares make"""


@dataclass
class Bucket:
    """One stream's fixed parts: its layout, the feedback's buffers each parameter's state is a
    view of (``held``), and a spare set, which a call fills and, once its sum is good, keeps as the
    state: the two alternate, with no copy (a call while another of the stream is in flight fills
    a new set)."""

    layout: BucketLayout
    states: tuple[TensorState, ...]
    """each segment's state in the pipeline when the bucket was built"""
    held: BufferSet
    whole_momentum: WholeMomentum | None = None
    """DGC's momentum of the parameters sent whole"""
    whole_error: WholeError | None = None
    """what a lossy value codec rounded off the parameters sent whole"""
    spare: BufferSet | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    """what each parameter's state in the feedback says once a proposal is kept (`kept_flags`)"""
    shares_agreed: int | None = None
    """the pipeline's own sparse steps run when the ranks last made their parameters' shares of
    the density one (None: not since it was built). The host path leaves each rank its own share:
    a checkpoint it wrote holds them, and so do the parameters after its steps (`Mode.SPARSE`)."""
    forms: dict[int, WireFormat] = field(default_factory=dict)
    """the buffer's format by capacity, the latest `FORMS_KEPT`: each places its fields once"""

    def form(self, capacity: int, spec: PipelineSpec) -> WireFormat:
        """The buffer's format for ``capacity`` selected entries and the entries sent whole."""
        form = self.forms.pop(capacity, None)
        if form is None:
            whole = self.layout.whole.numel() if self.layout.whole is not None else 0
            form = WireFormat(self.layout.numel, capacity, whole, spec.value_codec,
                              packed=isinstance(spec.index_codec, PackedIndices))
            if len(self.forms) >= FORMS_KEPT:
                self.forms.pop(next(iter(self.forms)))  # the least recently used
        self.forms[capacity] = form
        return form

    def current(self, segments: tuple[Segment, ...], numel: int, states: dict[str, TensorState],
                uncompressed: dict[str, dict[str, Any]], device: torch.device) -> bool:
        """Whether the bucket still serves a call laid out as ``segments`` over ``numel`` entries
        (a caller may lay one stream out anew) on ``device`` (not after the model moved), and
        every parameter's state still is this bucket's view: the pipeline's (``states``) and the
        uncompressed feedback's are the ones it was built on (not after a checkpoint was loaded) and
        hold its views (not after the parameter moved to another bucket). The codec's error of the
        entries sent whole is reclaimed instead (`WholeError.reclaim`)."""
        if self.layout.numel != numel or self.layout.segments != segments or self.layout.device != device:
            return False
        return (all(states.get(segment.key) is state for segment, state in zip(segments, self.states, strict=True))
                and all(state.feedback.get(name) is view for state, name, view in self.held.views)
                and (self.whole_momentum is None or self.whole_momentum.current(uncompressed)))

    def own_momentum(self) -> None:
        """DGC's momentum buffers are this rank's own from this step on (a dense step made them the
        ranks' common one: `DGCMomentum.flush` then sends what they hold), as the host path's
        `DGCMomentum.accumulate` says. The parameters of a bucket take their steps together, so the
        first one's flag tells."""
        if self.held.views and self.held.views[0][0].feedback.get("averaged"):
            for state, _, _ in self.held.views:
                state.feedback["averaged"] = False

    def take_spare(self) -> BufferSet:
        spare, self.spare = self.spare, None
        return spare if spare is not None else self.held.like()

    def keep(self, filled: BufferSet) -> None:
        """``filled`` becomes the state, each parameter's a view of it; the old set the spare."""
        self.held, self.spare = filled, self.held
        for state, name, view in filled.views:
            state.feedback[name] = view
            state.feedback.update(self.flags)


@dataclass
class DeviceSent:
    """What one call sent and proposed: its buffer's format, the indices and their values as
    delivered, the feedback's proposal, whether this rank's gradient and what it delivered were
    finite (None: no check), the gathered buffers and their bytes."""

    bucket: Bucket
    spare: BufferSet
    """the set the proposal fills"""
    form: WireFormat
    indices: torch.Tensor
    delivered: torch.Tensor | None
    """the selected values as the receivers decode them (None: exactly as sent)"""
    proposal: Proposal
    finite: torch.Tensor | None
    gathered: torch.Tensor
    nbytes: int
    header: int
    """the header word every rank's buffer must carry (`stamped`)"""
    agreed: torch.Tensor | None = field(default=None)
    sum_finite: torch.Tensor | None = None
    kept: bool = False
    """whether this rank's gradient was finite, once the sum is checked"""
    magnitude: torch.Tensor | None = None
    """the largest |value| sent, where ``adaptive``'s report needs it (read with the sum's check)"""
    share: torch.Tensor | float | None = None
    """the share of the density this rank's gradient proposes for the next step, where the
    selection shared it out by one threshold over the bucket"""
    within: bool = False
    """whether the selection kept to the planned density's capacity (a user's byte budget)"""
    agreed_share: torch.Tensor | None = None
    """the largest share any rank proposed, once the sum is known"""
    whole_sent: torch.Tensor | None = None
    """the entries sent whole with their codec's earlier error, where the codec rounds them"""


class DevicePath(Path):
    route = Route.DEVICE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buckets: dict[str, Bucket] = {}
        """per stream: its fixed parts (rebuilt from the parameters' states when stale)"""

    @property
    def spec(self) -> PipelineSpec:
        """The pipeline this route runs (`ReducerConfig.device_spec`)."""
        spec = self.parts.config.device_spec
        assert spec is not None, "a call took the device route of a pipeline without a device form"
        return spec

    def post(self, call: Call, plan: Plan | None, start: float) -> Pending:
        parts = self.parts
        config, pipeline, spec = parts.config, parts.pipeline, self.spec
        flat = call.tensor.detach().reshape(-1)
        segments = call.segments or (Segment(call.key, 0, flat.numel()),)
        first = pipeline.states.setdefault(segments[0].key, TensorState())
        bucket = self._bucket(call.key, segments, flat, first.step)
        layout = bucket.layout
        header = stamped(layout.digest, first.step)
        ratio = self._ratio(plan, first.step)
        grad, finite = self._screened(flat)
        adaptive = parts.adaptive
        if adaptive is not None:  # this step's sample of the gradient, where it takes one: the bucket's
            adaptive.planner.sample_energy(flat, [(0, layout.numel)])
        if isinstance(spec.feedback, DGCMomentum):
            bucket.own_momentum()
        spare = bucket.take_spare()
        proposal = propose(spec.feedback, grad, bucket.held.buffers, spare.buffers)
        generator = seeded_generator(flat.device, config.seed, key_hash(call.key), first.step)
        proposed, within = None, False
        if plan is not None and isinstance(spec.sparsifier, Adaptive):  # one threshold over the bucket
            within = spec.sparsifier.budget > 0
            share = self._share(bucket, within)
            indices, proposed = select_shared(proposal.accumulated, layout, ratio, share, generator, within)
        else:
            indices = select(proposal.accumulated, layout, ratio, generator)
        values = proposal.accumulated[indices]
        if layout.whole is not None:  # then every entry of the parameters sent whole, with the codec's error
            whole = bucket.whole_error.sent(grad) if bucket.whole_error is not None else grad[layout.whole]
            values = torch.cat([values, whole])
        if finite is not None:  # a non-finite rank sends NaN (raise: every rank raises) or nothing (skip)
            values = torch.where(finite, values, math.nan if config.screening == "raise" else 0.0)
        magnitude = None  # the largest sent, where adaptive's report needs it: read with the sum's check
        if adaptive is not None and adaptive.report_needed(parts.stats.steps):
            magnitude = largest_magnitude(values) if values.numel() else values.new_zeros(())
        form = bucket.form(indices.numel(), spec)
        # a new buffer per call: a stream's earlier call (reduce_async) may still be on the wire
        wire = torch.empty(form.words, dtype=torch.int32, device=flat.device)
        # the codecs take fp32 (as a half-precision gradient's feedback is kept: `state_dtype`)
        delivered = form.pack(wire, header, indices, values.float(), proposed)
        if finite is not None and not device_values.lossless(form.values) and math.isfinite(form.values.largest()):
            # a finite entry beyond a narrow float format's range arrives as Inf: a refused call keeps no such
            # proposal (fp32, and int8 with its scales, carry every finite value: no check)
            finite = finite & torch.isfinite(delivered.sum())
        whole_sent = None
        if bucket.whole_error is not None:
            whole_sent = values[form.capacity:]
            bucket.whole_error.propose(whole_sent, delivered[form.capacity:])
        posted = on_wire(wire, parts.wire_device)
        parts.calls.in_order()  # after a custom loop's plain calls on the worker thread
        gathered = torch.empty(config.world_size * wire.numel(), dtype=wire.dtype, device=posted.device)
        work = all_gather_single(gathered, posted, group=parts.process_group, async_op=True)
        sent = DeviceSent(bucket, spare, form, indices,
                          None if device_values.lossless(form.values) else delivered[:form.capacity],
                          proposal, finite, gathered, wire.numel() * wire.element_size(), header, magnitude=magnitude,
                          share=proposed, within=within, whole_sent=whole_sent)
        submitted = time.perf_counter()
        if adaptive is not None:
            # planned: the floors' count, so that a share's bytes count as the cost of a planned entry
            adaptive.measuring.submitted(flat.numel(), layout.sparsified_numel, layout.at_ratio(ratio).capacity, 0,
                                         submitted - start, submitted)
        return Pending(work.get_future(), submitted, finish_with_step=call.in_step, sent=sent)

    def _share(self, bucket: Bucket, within: bool) -> float:
        """The bucket's share of the density for this step (`sparsecomm.device.shares`): this rank's
        own within a byte budget, else the ranks' one, which sizes every rank's buffer — agreed
        by an all_reduce the first time after the bucket is built or the host path stepped its
        parameters (a count every rank has alike)."""
        sparsified = bucket.layout.sparsified_segments
        states = [self.parts.pipeline.states[segment.key] for _, segment in sparsified]
        share = max((state.density_share for state in states), default=1.0)
        adaptive = self.parts.adaptive
        host_steps = adaptive.planner.mode_steps.get(Mode.SPARSE, 0) \
            if adaptive is not None and not self.parts.config.on_device else 0
        if within or bucket.shares_agreed == host_steps:
            return share
        self.parts.calls.in_order()
        largest = on_wire(torch.tensor([share], dtype=torch.float32), self.parts.wire_device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.parts.process_group)
        share = float(largest)
        for state in states:
            state.density_share = share
        bucket.shares_agreed = host_steps
        return share

    def _ratio(self, plan: Plan | None, step: int) -> float:
        """The density the call's capacity is sized by: the sparsifier's ratio at ``step``, or
        ``adaptive``'s planned density (every rank plans the same)."""
        sparsifier = self.spec.sparsifier
        if isinstance(sparsifier, Adaptive):
            return sparsifier.at_density(plan.density if plan is not None else sparsifier.density).density
        sparsifier = sparsifier.at_step(step)
        assert isinstance(sparsifier, CountedSparsifier) and sparsifier.ratio is not None
        return sparsifier.ratio

    def _screened(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradient to use and, unless the policy is ``zero``, whether it was finite: a 0-d bool
        on the device, read by no one here (one reduction: a sum that overflows counts as
        non-finite). What a non-finite gradient proposes is sent as the policy says, never kept."""
        if self.parts.config.screening == "zero":
            return torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0), None
        return flat, torch.isfinite(flat.sum())

    def _bucket(self, key: str, segments: tuple[Segment, ...], flat: torch.Tensor, step: int) -> Bucket:
        bucket = self._buckets.get(key)
        # first built, laid out anew, or its states replaced (a load)
        if bucket is None or not bucket.current(segments, flat.numel(), self.parts.pipeline.states,
                                                self.parts.uncompressed.states, flat.device):
            bucket = self._build(segments, flat)
            self._agree_layout(key, bucket.layout, step)
            self._buckets[key] = bucket
        elif bucket.whole_error is not None:  # the entries sent whole: their error, where another route left it
            bucket.whole_error.reclaim()
        return bucket

    def _agree_layout(self, key: str, layout: BucketLayout, step: int) -> None:
        """A bucket's first call, and its first after its states were replaced (a checkpoint loaded),
        checks that every rank laid it out alike and is at the same step (one small all_reduce): its
        wire's length follows from the layout and the step's density, and a gather of unequal lengths
        aborts the process on gloo, where the header each wire carries would otherwise tell."""
        if self.parts.config.world_size == 1:
            return
        self.parts.calls.in_order()
        agreed = on_wire(torch.tensor([layout.digest, -layout.digest, step, -step], dtype=torch.int64),
                         self.parts.wire_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.parts.process_group)
        highest, lowest, latest, earliest = agreed.tolist()
        if highest != -lowest:
            raise SparseCommError(f"the ranks' buckets differ in {key!r}: every rank must build the same model and "
                                  "DDP the same buckets")
        if latest != -earliest:
            raise SparseCommError(f"the ranks are at different steps of {key!r} (steps {-earliest} to {latest}): "
                                  "every rank must load the checkpoint of the same step")

    def _build(self, segments: tuple[Segment, ...], flat: torch.Tensor) -> Bucket:
        """A bucket's flat buffers from its parameters' states (zeros where they have none), each
        parameter's state then a view of its segment."""
        pipeline, feedback = self.parts.pipeline, self.spec.feedback
        states = [pipeline.states.setdefault(s.key, TensorState()) for s in segments]
        buffers, views = {}, []
        sparsified = [(state, segment) for state, segment in zip(states, segments, strict=True) if not segment.whole]
        for name in buffer_names(feedback):
            buffers[name] = flat.new_zeros(flat.numel() + 1, dtype=state_dtype(flat.dtype))
            held = hold_in(buffers[name], name, [(state.feedback, s.start, s.numel) for state, s in sparsified])
            views += [(state, name, view) for (state, _), view in zip(sparsified, held, strict=True)]
        layout = BucketLayout.of(segments, flat.numel(), flat.device)
        return Bucket(layout, tuple(states), BufferSet(buffers, views),
                      WholeMomentum.of(feedback, layout, self.parts.uncompressed.states),
                      WholeError.of(self.spec.value_codec, layout, states), flags=kept_flags(feedback))

    def summed(self, call: Call, pending: Pending, done: torch.futures.Future) -> Summed:
        done.wait()
        sent: DeviceSent = pending.sent
        layout = sent.bucket.layout
        tensor = call.tensor  # this rank's gradient is in the wire: the sum may land in its buffer
        out = tensor.view(-1) if not tensor.is_sparse and tensor.dtype == torch.float32 and tensor.is_contiguous() \
            else None
        total, sent.agreed, sent.sum_finite, sent.agreed_share = sent.form.unpack_sum(
            sent.gathered, self.parts.config.world_size, sent.header, layout.whole, tensor.device, out,
            shares=sent.share is not None and not sent.within)
        return Summed(total, sent.nbytes, owned=True)

    def checked(self, call: Call, pending: Pending, summed: Summed) -> torch.Tensor:
        """The sum, raising on every rank unless every rank's bucket had this layout and the sum is
        finite: the call's one host read (`sparsecomm.device.status`), which also brings the
        ``adaptive`` controller what it asked of the call."""
        sent: DeviceSent = pending.sent
        assert sent.agreed is not None and sent.sum_finite is not None
        # whether the sum is good (every rank's layout; finite, overflow included) and this rank's own
        # gradient was finite (under "skip" it sent zeros, and its feedback takes a zero gradient's step)
        good = sent.agreed & sent.sum_finite
        flags = good * GOOD + (sent.finite if sent.finite is not None else good) * OWN_FINITE  # int64
        adaptive = self.parts.adaptive
        # the step's last call reads the density the step's gradient prefers, where it was sampled
        preferred = adaptive.planner.costs.energy_choice(adaptive.measuring.energy_samples,
                                                         adaptive.planner.current.mode) \
            if adaptive is not None and call.last else None
        # the next step's share: this rank's own within a budget (a number where the choice was made in
        # host memory, read with nothing), else the largest any rank proposed, which sizes every rank's
        # next buffer alike; a tensor comes with the status word
        share = sent.share if sent.within else sent.agreed_share
        on_device = share if isinstance(share, torch.Tensor) else None
        status = read(flags, sent.magnitude, preferred, on_device)
        if adaptive is not None:
            if status.magnitude is not None and status.good and status.own_finite:
                adaptive.measuring.saw_magnitude(status.magnitude)
            if status.density is not None:
                adaptive.measuring.preferred_density = status.density
        sent.kept = status.own_finite
        share = status.share if on_device is not None else share
        if status.good and share is not None:
            for segment in call.segments or (Segment(call.key, 0, call.tensor.numel()),):
                self.parts.pipeline.states[segment.key].density_share = rounded(float(share))
        if not status.good:
            if not bool(sent.agreed):
                raise SparseCommError(f"the ranks' buckets differ in {call.key!r}, or the ranks are at different "
                                      "steps of it, or a rank's buffer is not one of this layout: every rank must "
                                      "build the same model and DDP the same buckets, and resume from the same step")
            raise non_finite_sum(call.key)
        return summed.total

    def measured(self, call: Call, pending: Pending, summed: Summed) -> None:
        """The adaptive controller's share: the selection's slots are the payload (their bytes per
        entry hold what the padding and the header cost), the entries sent whole are fixed bytes."""
        assert self.parts.adaptive is not None
        form: WireFormat = pending.sent.form
        whole_bytes = form.whole_bytes
        measuring, now = self.parts.adaptive.measuring, time.perf_counter()
        measuring.finished(now, summed.bytes_sent - whole_bytes, payload_nnz=form.capacity)
        measuring.finished(now, whole_bytes)

    def withdrawn(self, call: Call, pending: Pending) -> None:
        """Every rank raises at this call: where this rank's gradient was finite, its proposal is
        kept as if nothing had been sent, so its feedback holds this step's gradient too, to go
        out with a later step (as the codecs' route takes back what it selected), and so does the
        codec's error of the entries sent whole, where the codec rounds them (an exact codec keeps
        no error: their step's gradient is lost); its step count stays, as on every rank."""
        sent: DeviceSent = pending.sent
        bucket = sent.bucket
        if not sent.kept:
            self._sit_out(sent)
            return
        commit(self.spec.feedback, sent.proposal, sent.indices[:0], bucket.layout.whole)
        bucket.keep(sent.spare)
        if bucket.whole_error is not None and sent.whole_sent is not None:
            bucket.whole_error.spare.copy_(sent.whole_sent)
            bucket.whole_error.keep()

    def _sit_out(self, sent: DeviceSent) -> None:
        """This rank's gradient (or what it delivered) was non-finite: its feedback takes the step
        of a zero gradient, nothing sent, as the host path's does (`Pipeline.idle`) — DGC's
        momentum decays as every other rank's steps — in the spare set, which becomes the state."""
        bucket = sent.bucket
        feedback = self.spec.feedback
        if not isinstance(feedback, DGCMomentum):  # a zero gradient leaves any other feedback as it is
            bucket.spare = sent.spare
            return
        zeros = bucket.held.buffers["momentum_buffer"].new_zeros(bucket.layout.numel)
        proposal = propose(feedback, zeros, bucket.held.buffers, sent.spare.buffers)
        commit(feedback, proposal, sent.indices[:0], bucket.layout.whole)
        bucket.keep(sent.spare)

    def after_average(self, call: Call, pending: Pending, total: torch.Tensor) -> torch.Tensor:
        sent: DeviceSent = pending.sent
        if sent.finite is None or sent.kept:
            commit(self.spec.feedback, sent.proposal, sent.indices, sent.bucket.layout.whole,
                   sent.delivered)
            sent.bucket.keep(sent.spare)
            if sent.bucket.whole_error is not None:
                sent.bucket.whole_error.keep()
        else:
            self._sit_out(sent)
        states = self.parts.pipeline.states
        for segment in call.segments or (Segment(call.key, 0, total.numel()),):
            states[segment.key].step += 1
        if sent.bucket.whole_momentum is not None:
            sent.bucket.whole_momentum.step_(total.view(-1))
        return total
