"""``low rank``: a step the ``adaptive`` controller planned as low-rank (`Mode.LOW_RANK`; PowerSGD,
Vogels et al. 2019, rank r), which with ``adaptive(low_rank=r)`` replaces its warm-up's top-k.
Each matrix M of a call — its gradient plus its residual, viewed as
(first dimension) × (the rest) — goes as P = M·Q, summed over ranks and orthonormalized into P̂,
then as Q' = Mᵀ·P̂, averaged into Q̄; every rank takes P̂·Q̄ᵀ for the average and keeps
M − P̂·Q̄ᵀ in its residual, and Q̄ warm-starts the next low-rank step (`TensorState.low_rank`, the
first drawn from a generator of the reducer's seed and the tensor's name, alike on every rank).
Vectors, tensors sent whole, matrices too small for r to halve them, and tensors of unknown shape
travel exactly, in fp32, beside P, with a report the planner must hear in their tail.

P and Q travel in bf16 (`FACTORS`): half fp32's bytes, and fp32's range, which P needs (a product
of two gradient-sized factors underflows fp16); every rank orthonormalizes and multiplies the same
rounded sums, and each residual is measured against that average, so the rounding is fed back too.

The first all_reduces (P, and what travels exactly) are posted at once. Over gloo a call's second
(Q) goes when the step's next call has posted its first, so it crosses the link while the backward
pass computes, as the first did; over NCCL, and for the step's last call, it goes when the step
finishes, on the thread that finishes it (reading a GPU's sums mid-backward would hold the host
until the device caught up). Either way the calls' collectives come in one order on every rank.

Matrices of one shape go through each product together (batched), read and written in place where
they lie at a regular stride in the call's flat tensor (a transformer's blocks), else gathered by
an index."""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sparsecomm.adaptive.config import Plan
from sparsecomm.adaptive.flat_residual import FlatResidual
from sparsecomm.adaptive.flush import flush, update_flushed
from sparsecomm.feedback.base import held, state_dtype
from sparsecomm.finite import all_finite
from sparsecomm.pipeline import Segment, TensorState
from sparsecomm.reducer.call import Call, Route, Summed
from sparsecomm.reducer.paths.base import Parts, Path, Pending, non_finite_sum
from sparsecomm.reducer.paths.scratch import Scratch
from sparsecomm.transport.collectives import on_wire
from sparsecomm.transport.side_numbers import read_tail, tail_elements, write_tail
from sparsecomm.transport.waiting import wait_polling

FACTORS = torch.bfloat16
"""the dtype P and Q travel in"""

MIN_COMPRESSION = 2.0
"""a matrix goes low-rank only where its n·m entries are at least this many times the r(n + m) it
would send (as PyTorch's PowerSGD hook decides)"""


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The batched product a·b of a thin result (r columns), as (bᵀ·aᵀ)ᵀ: the same numbers, as a
    view. On a processor torch's batched product runs several times faster this way round (gpt's
    matrices at rank 8, one thread: M·Q and Mᵀ·P 6.5 ms a step against 1.2)."""
    return torch.bmm(b.transpose(1, 2), a.transpose(1, 2)).transpose(1, 2)


@dataclass(frozen=True)
class Group:
    """The call's matrices of one shape (n × m): their segments' keys and an index of their
    entries in the flat call, matrix after matrix."""

    shape: tuple[int, int]
    keys: tuple[str, ...]
    index: torch.Tensor
    stride: tuple[int, int] | None
    """(first start, distance between starts) where the matrices lie at a regular stride"""

    def of(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The group's matrices as a (count × n × m) view of the flat contiguous ``flat``, where
        they lie at a regular stride (None otherwise)."""
        if self.stride is None:
            return None
        start, step = self.stride
        return flat.as_strided((len(self.keys), *self.shape), (step, self.shape[1], 1), flat.storage_offset() + start)

    def gathered(self, flat: torch.Tensor) -> torch.Tensor:
        """The group's matrices of ``flat``: a view where they lie at a regular stride, else a copy."""
        view = self.of(flat)
        return view if view is not None else flat.index_select(0, self.index).view(len(self.keys), *self.shape)

    def scatter(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` (count × n × m) into the group's places of ``flat``."""
        view = self.of(flat)
        if view is not None:
            view.copy_(values)
        else:
            flat.index_copy_(0, self.index, values.reshape(-1))


@dataclass(frozen=True)
class Layout:
    """How one call's flat gradient splits: its matrices by shape, and the flat positions of
    everything sent exactly."""

    groups: tuple[Group, ...]
    exact: torch.Tensor

    def q_numel(self, rank_r: int) -> int:
        return sum(len(g.keys) * g.shape[1] * rank_r for g in self.groups)


@dataclass
class SecondRound:
    """A call's second all_reduce (Q), posted once its first was summed; or why none went."""

    first: Summed
    """the first all_reduces' sums: what the call returns where one was non-finite (the same on
    every rank), and the report numbers they carried"""
    orthonormal: list[torch.Tensor] = field(default_factory=list)
    """per group: P̂, the summed P orthonormalized"""
    exact: torch.Tensor | None = None
    """the sum of what travelled exactly (None: a sum was non-finite, no Q went)"""
    q_wire: torch.Tensor | None = None
    work: torch.distributed.Work | None = None
    error: BaseException | None = None
    """what reading the first all_reduces or posting the second met: the call raises it"""


@dataclass
class Sent:
    """What a call's first all_reduces carried, and what its second needs."""

    flat: torch.Tensor
    """the gradient plus residual (flat, scratch)"""
    home: torch.Tensor
    """the gradient's flat buffer: the average goes there"""
    layout: Layout
    matrices: list[torch.Tensor]
    """per group: its matrices stacked (count × n × m)"""
    qs: list[torch.Tensor]
    """per group: its matrices' Qs stacked (count × m × r), each state holding its view"""
    carrying: int | None
    """where the report's tail starts in what travels exactly (None: no report)"""
    posted: tuple[bool, bool]
    """whether P, and what travels exactly, each had an all_reduce (a call may have none of one)"""
    nbytes: int
    raised: bool
    """this rank's own gradient was non-finite (it sent NaN, its state untouched)"""
    second: SecondRound | None = None
    """its second all_reduce, once posted"""


class LowRankPath(Path):
    route = Route.LOW_RANK

    def __init__(self, parts: Parts, shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        super().__init__(parts)
        self.shapes = dict(shapes or {})
        """each parameter's shape by name (a DDP model's); a call's own tensor tells its shape otherwise"""
        self._layouts: dict[tuple[str, int], Layout] = {}
        self._scratch = Scratch()
        """per stream: the buffer its gradient plus residual is flushed into"""
        self._qs: dict[tuple[str, tuple[int, int], int], torch.Tensor] = {}
        """per stream, matrix shape and rank: the group's Qs stacked, each matrix's state a view"""
        self._residuals: dict[str, FlatResidual] = {}
        self._open: list[tuple[Call, Sent, torch.futures.Future]] = []
        """the step's calls whose second all_reduce waits for the next call's post"""

    def post(self, call: Call, plan: Plan | None, start: float) -> Pending:
        parts, adaptive = self.parts, self.parts.adaptive
        assert adaptive is not None and plan is not None
        rank_r = adaptive.planner.sparsifier.low_rank
        home = call.tensor.view(-1) if call.tensor.is_contiguous() else call.tensor.reshape(-1).clone()
        flat, must_raise = flush(parts.pipeline, home, call.key, call.segments, out=self._buffer(call.key, home),
                                 sum_checked=True, buckets=self._residuals)
        layout = self._layout(call, rank_r, home.device)
        matrices = [group.gathered(flat) for group in layout.groups]
        qs = [self._stacked_q(call.key, group, rank_r, flat) for group in layout.groups]
        side = adaptive.reports.take(needed_only=True)
        tail = tail_elements(parts.config.world_size) if side is not None else 0
        factors = torch.cat([product(m, q).reshape(-1) for m, q in zip(matrices, qs, strict=True)]
                            or [flat.new_zeros(0)]).to(FACTORS)
        whole = torch.cat([flat.index_select(0, layout.exact), flat.new_zeros(tail)])
        carrying = None
        if side is not None:
            carrying = whole.numel() - tail
            write_tail(whole[carrying:], side, parts.rank)
        if must_raise:  # every rank's sum is non-finite: every rank raises
            factors.fill_(math.nan)
            whole[:whole.numel() - tail].fill_(math.nan)
        nbytes = ((factors.numel() + layout.q_numel(rank_r)) * factors.element_size()
                  + whole.numel() * whole.element_size())
        submitted = time.perf_counter()
        budget_numel = sum(numel for _, numel in call.density_spans())
        adaptive.measuring.submitted(call.tensor.numel(), budget_numel, 0, 0, submitted - start, submitted)
        posted = (factors.numel() > 0, whole.numel() > 0)
        parts.calls.in_order()  # after a sparse gradient's rows on the worker thread
        works = [parts.process_group.allreduce([on_wire(wire, parts.wire_device)])
                 for wire, post in zip((factors, whole), posted, strict=True) if post]
        # the second all_reduce must come in the same order on every rank: the step's thread posts
        # it, and a call outside a step completes on this thread, before it returns
        if not call.in_step:
            for work in works:
                work.wait()
        future = torch.futures.collect_all([work.get_future() for work in works])
        if call.in_step:
            self._post_second_rounds()  # the earlier calls' Q, behind this call's P
        sent = Sent(flat, home, layout, matrices, qs, carrying, posted, nbytes, must_raise)
        if call.in_step and parts.wire_device.type == "cpu":
            self._open.append((call, sent, future))
        return Pending(future, submitted, finish_with_step=call.in_step, carries_report=side is not None, sent=sent)

    def summed(self, call: Call, pending: Pending, done: torch.futures.Future) -> Summed:
        sent = pending.sent
        try:
            if sent.second is None:  # the step's last call, or one on NCCL
                self._open = [entry for entry in self._open if entry[1] is not sent]
                sent.second = self._second_round(call, sent, done)
            return self._completed(call, sent, sent.second)
        finally:  # the matrices are read: the stream's buffer is free for its next call
            self._scratch.give_back(call.key, sent.flat)

    def _post_second_rounds(self) -> None:
        """The second all_reduce of each of the step's earlier calls, each once its first is summed:
        posted from the backward pass, at the same place among the collectives on every rank."""
        waiting, self._open = self._open, []
        for call, sent, done in waiting:
            sent.second = self._second_round(call, sent, done)

    def _second_round(self, call: Call, sent: Sent, done: torch.futures.Future) -> SecondRound:
        """Read the first all_reduces' sums and post Q (not where a sum is non-finite); an error is
        kept for the call it belongs to to raise, not the call that is posting."""
        try:
            return self._post_q(call, sent, done)
        except Exception as error:  # noqa: BLE001 - raised by its own call, in `summed`
            return SecondRound(Summed(sent.flat.new_zeros(0), sent.nbytes), error=error)

    def _post_q(self, call: Call, sent: Sent, done: torch.futures.Future) -> SecondRound:
        with contextlib.suppress(Exception):  # a failed collective raises below, from its own future
            wait_polling(done)
        # each collective's own future: waiting on it makes a CUDA stream wait for NCCL's
        # (collect_all's future knows no devices, and value() waits for nothing)
        sums = iter(each.wait()[0] for each in done.value())
        device, dtype = sent.flat.device, sent.flat.dtype
        factors, exact = (next(sums).to(device, dtype) if posted else sent.flat.new_zeros(0) for posted in sent.posted)
        sides = None
        if sent.carrying is not None:
            sides = read_tail(exact[sent.carrying:])
            exact = exact[:sent.carrying]
        both = torch.cat([factors, exact])
        second = SecondRound(Summed(both, sent.nbytes, carried_report=sides is not None, sides=sides))
        if not all_finite(both):  # the same sums on every rank: none posts the second all_reduce
            self._restore(call, sent)
            return second
        offset = 0
        for m, q in zip(sent.matrices, sent.qs, strict=True):
            p = factors[offset:offset + m.shape[0] * m.shape[1] * q.shape[2]].view(m.shape[0], m.shape[1], q.shape[2])
            second.orthonormal.append(torch.linalg.qr(p.float()).Q.to(dtype))
            offset += p.numel()
        second.exact = exact
        if sent.matrices:
            second.q_wire = on_wire(torch.cat([product(m.transpose(1, 2), p).reshape(-1)
                                               for m, p in zip(sent.matrices, second.orthonormal, strict=True)]
                                              ).to(FACTORS), self.parts.wire_device)
            self.parts.calls.in_order()
            second.work = self.parts.process_group.allreduce([second.q_wire])
        return second

    def _completed(self, call: Call, sent: Sent, second: SecondRound) -> Summed:
        """The call's average, once its second all_reduce is summed (or why there is none)."""
        if second.error is not None:
            raise second.error
        if second.exact is None:
            return second.first
        world_size = self.parts.config.world_size
        if second.work is not None and second.q_wire is not None:
            second.work.wait()
            q_wire = second.q_wire.to(sent.flat.device, sent.flat.dtype)
            if not all_finite(q_wire):  # an overflow, the same on every rank
                self._restore(call, sent)
                return second.first
            offset = 0
            for q in sent.qs:
                q.copy_(q_wire[offset:offset + q.numel()].view_as(q)).div_(world_size)
                offset += q.numel()
        self._finish(call, sent, second.orthonormal, second.exact.div_(world_size))
        return Summed(sent.home, sent.nbytes, owned=True, averaged=True, carried_report=second.first.carried_report,
                      sides=second.first.sides)

    def _finish(self, call: Call, sent: Sent, orthonormal: list[torch.Tensor], exact: torch.Tensor) -> None:
        """The average into the gradient's buffer; each matrix's residual keeps what the average
        missed of it (its Q̄, in place, starts the next low-rank step)."""
        states, home = self.parts.pipeline.states, sent.home
        bucket = self._residuals.get(call.key)
        for group, m, p, q in zip(sent.layout.groups, sent.matrices, orthonormal, sent.qs, strict=True):
            residuals = bucket.buffer if bucket is not None and all(
                getattr(states[key].feedback.get("residual"), "_base", None) is bucket.buffer
                for key in group.keys) else None
            average = group.of(home) if home.dtype == m.dtype else None
            if residuals is not None and average is not None:  # written where they go: two passes, no copies
                torch.bmm(p, q.transpose(1, 2), out=average)
                torch.sub(m, average, out=group.of(residuals))
            else:
                # a half-precision gradient's average lands rounded, and its residual keeps the rounding
                approx = torch.bmm(p, q.transpose(1, 2)).to(home.dtype)
                group.scatter(home, approx)
                if residuals is not None:
                    group.scatter(residuals, m.sub_(approx))
                else:
                    for key, each in zip(group.keys, m.sub_(approx).reshape(len(group.keys), -1), strict=True):
                        held(states[key].feedback, "residual", each).copy_(each)
            for key in group.keys:
                states[key].feedback["clear"] = False
        home.index_copy_(0, sent.layout.exact, exact.to(home.dtype))

    def _restore(self, call: Call, sent: Sent) -> None:
        """A step every rank raises in: where this rank's gradient was finite, its tensors' step
        counts go back (the ranks stay at one step) and their residuals hold what the flush moved
        into the call, what they held and this step's gradient, as the codecs' route keeps what it
        selected. A rank whose own gradient raised flushed nothing."""
        if sent.raised:
            return
        for segment in self._segments(call):
            state = self.parts.pipeline.states.get(segment.key)
            if state is not None:
                state.step -= 1
            if segment.whole or state is None or state.feedback.get("clear") is not True:
                continue
            span = slice(segment.start, segment.start + segment.numel)
            if all_finite(sent.home[span]):
                held(state.feedback, "residual", sent.flat[span]).copy_(sent.flat[span])  # with this step's gradient
                state.feedback["clear"] = False

    def checked(self, call: Call, pending: Pending, summed: Summed) -> torch.Tensor:
        if not summed.owned:
            raise non_finite_sum(call.key)
        return summed.total

    def measured(self, call: Call, pending: Pending, summed: Summed) -> None:
        assert self.parts.adaptive is not None
        self.parts.adaptive.measuring.finished(time.perf_counter(), summed.bytes_sent, in_budget=True)

    def after_average(self, call: Call, pending: Pending, total: torch.Tensor) -> torch.Tensor:
        update_flushed(self.parts.pipeline, total, call.key, call.segments)
        return self.parts.uncompressed.apply(total, call.key, call.segments, whole_only=True)

    # -- layout and state -------------------------------------------------------------------------
    def _segments(self, call: Call) -> tuple[Segment, ...]:
        return call.segments or (Segment(call.key, 0, call.tensor.numel()),)

    def _buffer(self, key: str, home: torch.Tensor) -> torch.Tensor:
        """The stream's gradient plus residual, in the dtype the residual is kept in (`state_dtype`),
        taken until `summed` has read it."""
        return self._scratch.take(key, home.shape, state_dtype(home.dtype), home.device)

    def _layout(self, call: Call, rank_r: int, device: torch.device) -> Layout:
        """The call's matrices by shape and its exact positions (worked out once per stream)."""
        cache_key = (call.key, rank_r)
        known = self._layouts.get(cache_key)
        if known is not None and known.exact.device == device:
            return known
        by_shape: dict[tuple[int, int], list[Segment]] = {}
        exact: list[torch.Tensor] = []
        for segment in self._segments(call):
            shape = self.shapes.get(segment.key) if call.segments else tuple(call.tensor.shape)
            matrix = _as_matrix(shape, segment.numel) if not segment.whole else None
            if matrix is not None and rank_r * sum(matrix) * MIN_COMPRESSION <= matrix[0] * matrix[1]:
                by_shape.setdefault(matrix, []).append(segment)
            else:
                exact.append(torch.arange(segment.start, segment.start + segment.numel))
        groups = tuple(Group(shape, tuple(s.key for s in members),
                             torch.cat([torch.arange(s.start, s.start + s.numel) for s in members]).to(device),
                             _stride(members))
                       for shape, members in by_shape.items())
        index = torch.cat(exact).to(device) if exact else torch.zeros(0, dtype=torch.int64, device=device)
        layout = self._layouts[cache_key] = Layout(groups, index)
        return layout

    def _stacked_q(self, key: str, group: Group, rank_r: int, like: torch.Tensor) -> torch.Tensor:
        """The group's Qs (count × m × r) as one tensor whose slices its states hold: the last
        low-rank step's, else each drawn from the reducer's seed and the matrix's name."""
        states = self.parts.pipeline.states
        stacked = self._qs.get((key, group.shape, rank_r))
        if stacked is not None and stacked.device == like.device and stacked.dtype == like.dtype and all(
                getattr(states[name].low_rank, "_base", None) is stacked for name in group.keys):
            return stacked
        columns = group.shape[1]
        drawn = [self._q(states[name], name, columns, rank_r, like) for name in group.keys]
        stacked = self._qs[(key, group.shape, rank_r)] = torch.stack(drawn)
        for index, name in enumerate(group.keys):
            states[name].low_rank = stacked[index]
        return stacked

    def _q(self, state: TensorState, key: str, columns: int, rank_r: int, like: torch.Tensor) -> torch.Tensor:
        """A matrix's Q as its state holds it, else drawn from the reducer's seed and its name."""
        q = state.low_rank
        if q is not None and q.shape == (columns, rank_r):
            return q.to(like.device, like.dtype)
        generator = torch.Generator().manual_seed(self.parts.config.seed * 1_000_003 + zlib.crc32(key.encode()))
        return torch.randn(columns, rank_r, generator=generator).to(like.device, like.dtype)


def _stride(segments: list[Segment]) -> tuple[int, int] | None:
    """(first start, distance between starts) of equal-sized ``segments`` that follow one another
    at a regular stride (None otherwise)."""
    starts = [s.start for s in segments]
    step = starts[1] - starts[0] if len(starts) > 1 else segments[0].numel
    if step < segments[0].numel or any(b - a != step for a, b in zip(starts, starts[1:], strict=False)):
        return None
    return starts[0], step


def _as_matrix(shape: tuple[int, ...] | None, numel: int) -> tuple[int, int] | None:
    """A tensor of ``shape`` as a matrix: (first dimension, the rest); None for a vector, an empty
    tensor or an unknown shape (each sent exactly)."""
    if shape is None or len(shape) < 2 or numel == 0 or math.prod(shape) != numel:
        return None
    return shape[0], numel // shape[0]
