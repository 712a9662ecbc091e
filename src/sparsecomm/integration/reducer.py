"""`GradientReducer`: reduces named gradients over a process group with one pipeline — the engine
behind the DDP hook (`sparsecomm.ddp_comm_hook`) and custom loops (`GradientReducer.allreduce_`).

Per tensor (or DDP bucket) it runs the pipeline locally (feedback → sparsify → encode), sums the
contributions with the pipeline's transport, and averages over the ranks. Rules:

- State belongs to parameters, not to buffers: a DDP bucket is cut into its parameters (from
  ``GradBucket.parameters()`` and where each gradient sits in the bucket), each sparsified with its
  own residual or momentum, all sent together. DDP's bucket rebuild after the first step, or a
  fresh DDP after a resume, changes which parameters share a bucket, never whose state is whose.
- Dense tensors with fewer than ``dense_below`` elements (biases, norms, small last buckets) go
  through a plain fp32 all_reduce with no feedback: compressing them saves nothing. Inside a
  compressed bucket, such parameters are sent whole (every nonzero, no sparsifier); what a lossy
  codec rounds off them goes with their next step (`TensorState.codec_error` in `sparsecomm.pipeline`).
- Sparse COO gradients (``nn.Embedding(sparse=True)``) are already sparse: all their rows are sent
  (no sparsifier) through the pipeline's transport, or ``allgather`` if that is ``dense`` or inexact
  (a sketch, a quantized dense phase), with the pipeline's codecs where they are lossless; where its
  value codec is a deterministic rounding (int8, fp16, bf16), in that format, each entry's error held
  until its row is sent again (`_rows_rounded`); else exactly (`sparsecomm.encode.exact`), since a
  codec whose error is not known per entry would lose it. The result is a sparse COO tensor again.
  Never through gloo's sparse all_reduce, dense steps included: with DDP it can corrupt the heap
  (the README's known platform issue).
- Tensors sent these two uncompressed ways still get what the feedback owns in place of the
  optimizer: with ``dgc_momentum``, the same momentum, applied to their average over ranks.
- Non-finite input follows the pipeline's ``nonfinite`` policy; under ``"raise"`` every rank raises
  together (the flag rides on the transport's agreement step), none is left waiting. So does every
  rank when one rank's codec refuses its values (a value beyond fp16's range, say).
- Every call's agreement step carries the tensor's key and call number: ranks that pass different
  tensors, orders or counts get `SparseCommError` naming the key, never a sum of the wrong tensors.
- At construction all ranks check they have the same spec, seed, options and world size.
- With the ``adaptive`` sparsifier, a `LinkBudget` plans every step — dense fp32, dense fp16 or
  sparse at a byte budget — from numbers every rank reported; dense steps run as DDP's own hooks
  run a bucket (the feedback flushed into it, one asynchronous all_reduce, no agreement step: a
  non-finite gradient travels as NaN so every rank's sum is non-finite and every rank raises),
  sparse gradients' rows exactly, with the step's last call,
  and DGC's momentum follows the average there, as DDP's optimizer's would — on a CPU applied
  when the step is finished (`finish_step`), on the thread that waits for it, not on gloo's.

Collectives run on a process group of their own (created here, on every rank, with what the
transport's calls need, `Transport.prepare`): asynchronous calls on the reducer's `TransportSession`
thread, in submission order, so they never interleave with the caller's collectives; a step's last
call on the caller's thread once the calls before it are done (nothing is left to overlap it with).
Payload calls expected to send few entries (`FUSE_BELOW`, decided from numbers every rank shares),
and sparse gradients' rows, wait for the step's last call and travel with it in one exchange: each
would cost mostly an exchange's fixed cost, and an embedding's rows are ready only as the backward
pass ends. The reducer owns all runtime state — per-parameter pipeline state, auto's measurements,
the adaptive budget and its reports in flight, call counters, the calls waiting for the step's last,
the worker thread — checkpoints it with ``state_dict()`` and releases it with ``close()`` (or
``with``).
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.encode.exact import exact_codecs, raw_codecs
from sparsecomm.errors import SparseCommError
from sparsecomm.finite import all_finite
from sparsecomm.integration.budget import HALF, MIN_WIRE_BYTES, LinkBudget, Plan
from sparsecomm.integration.link_probe import link_throughput, probe_numel
from sparsecomm.integration.presets import resolve
from sparsecomm.integration.reports import BudgetReports
from sparsecomm.payload import encode
from sparsecomm.pipeline import Pipeline, Segment, screen_nonfinite
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.adaptive import Adaptive
from sparsecomm.spec import PipelineSpec, format_spec
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.allgather import AllgatherTransport, FusedCall, codecs_of
from sparsecomm.transport.base import Transport
from sparsecomm.transport.collectives import fingerprint, on_wire, wire_device
from sparsecomm.transport.dense import DenseTransport
from sparsecomm.transport.request import Reduction, Request
from sparsecomm.transport.session import TransportSession
from sparsecomm.transport.side_numbers import read_tail, tail_elements, write_tail
from sparsecomm.transport.waiting import wait_polling

DENSE_BELOW = 4096
FUSE_BELOW = 1 << 14
"""a payload-carrying call expected to send fewer entries than this waits for its step's last call
and travels in one exchange with it (`AllgatherTransport.reduce_fused`): such calls cost mostly a
call's fixed cost, while larger ones gain more from starting while the backward pass runs. A sparse
gradient's rows always wait (0: nothing waits): an embedding is the model's first layer, so its rows
are ready as the backward pass ends, with little left to overlap them with, and how many rows each
rank has is not known alike before the exchange"""
EVERY_STEP_REPORTS, REPORT_EVERY = 8, 4
"""the adaptive pipeline's budget must hear every rank's numbers after each of the first steps, then
after every few: those reports go in a small all_reduce of their own when no call of the next step
can carry them (see `sparsecomm.integration.reports`)"""


@dataclass
class TensorStats:
    """Totals for one tensor or bucket since the reducer started (or was loaded)."""

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    select_s: float = 0.0
    transport_s: float = 0.0
    decode_s: float = 0.0
    path: str = ""

    @property
    def compression_ratio(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")


@dataclass
class ReducerStats:
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    steps: int = 0

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes_sent for t in self.tensors.values())

    @property
    def dense_bytes(self) -> int:
        return sum(t.dense_bytes for t in self.tensors.values())

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.steps, "bytes_sent": self.bytes_sent, "bytes_per_step": self.bytes_per_step,
            "compression_ratio": self.compression_ratio,
            "select_s": sum(t.select_s for t in self.tensors.values()),
            "transport_s": sum(t.transport_s for t in self.tensors.values()),
            "decode_s": sum(t.decode_s for t in self.tensors.values()),
        }


def _result_future(tensor: torch.Tensor) -> torch.futures.Future:
    """The future a call's sum is handed back in. For a CUDA gradient it knows the device, so that
    setting it records the setter's stream and a waiter's stream waits for that work: the callbacks
    of c10d's futures run on side streams, and DDP copies the sum into the gradients on its own."""
    return torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda" else torch.futures.Future()


def _default_group() -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group()


def parameter_of(key: str, segments: list[Segment] | None) -> str:
    """The parameter a call's gradient belongs to: its bucket's only segment, or the call's key."""
    return segments[0].key if segments else key


def nonzero_rows(dense: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """A coalesced sparse COO tensor of ``dense``'s nonzero slices over its first ``sparse_dim``
    dimensions — what ``dense.to_sparse(sparse_dim)`` returns, built from one reduction and one
    row gather (torch's conversion costs tens of µs per row on CPU). A row is nonzero where its
    largest magnitude is (NaN included, −0.0 not, as ``!= 0`` decides): on the host that reduction
    is ten times faster than ``(rows != 0).any(1)``."""
    leading = dense.shape[:sparse_dim]
    flat = dense.reshape(math.prod(leading), -1)
    if flat.shape[1] == 0:
        rows = torch.zeros(0, dtype=torch.int64, device=dense.device)
    else:
        rows = (flat.abs().amax(1) != 0).nonzero().squeeze(1)
    indices = torch.stack(torch.unravel_index(rows, leading)) if sparse_dim > 1 else rows[None]
    values = flat.index_select(0, rows).reshape((len(rows), *dense.shape[sparse_dim:]))
    return torch.sparse_coo_tensor(indices, values, dense.shape, is_coalesced=True, check_invariants=False)


@dataclass(frozen=True)
class NativeWire:
    """What one call of a dense step sends: the tensor all_reduced, its path (``dense``, ``flush`` or
    ``half``), its bytes, the gradient's flat buffer the sum goes back into, and — when the call
    carries a budget report — how many leading elements are gradient (the rest is the report's
    tail)."""

    tensor: torch.Tensor
    path: str
    nbytes: int
    home: torch.Tensor
    carrying: int | None = None


class GradientReducer:
    """Averages gradients over ``group`` with the pipeline named by ``spec`` (a spec or a preset).

    Args:
        spec: a preset name (``"dgc"``) or a pipeline spec string, or a parsed `PipelineSpec`.
        group: the process group (default: ``model``'s if it is a DDP model, else the world).
        seed: seeds every random choice; all ranks must pass the same.
        nonfinite: ``"raise"``, ``"skip"`` or ``"zero"`` (see the module docstring).
        dense_below: tensors (and DDP buckets) with fewer elements go by plain all_reduce.
        average: divide the sum by the world size.
        model: the model (DDP or its module) whose parameter names key the per-parameter state;
            needed as a DDP hook state.

    Example::

        reducer = sc.GradientReducer("dgc", model=ddp_model)
        ddp_model.register_comm_hook(reducer, sc.ddp_comm_hook)
    """

    def __init__(self, spec: str | PipelineSpec, group: dist.ProcessGroup | None = None, seed: int = 0,
                 nonfinite: str = "raise", dense_below: int = DENSE_BELOW, average: bool = True,
                 model: nn.Module | None = None) -> None:
        if not dist.is_initialized():
            raise SparseCommError("torch.distributed is not initialised: call init_process_group first")
        if group is None and model is not None:
            group = getattr(model, "process_group", None)
        self.spec = resolve(spec)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.seed, self.nonfinite, self.dense_below, self.average = seed, nonfinite, dense_below, average
        self.pipeline = Pipeline(self.spec, seed=seed, nonfinite=nonfinite, world_size=self.world_size)
        self.stats = ReducerStats()
        self.session = TransportSession()
        module = getattr(model, "module", model)
        self._names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
        """parameter object → its name in the model, for DDP buckets"""
        self._calls: dict[str, int] = {}
        """per stream key: calls so far (the agreement step checks every rank is at the same call)"""
        self._in_flight: list[torch.futures.Future] = []
        self._deferred: list[tuple[FusedCall, torch.futures.Future]] = []
        """this step's small calls waiting to travel with its last (`FUSE_BELOW`)"""
        self._unfinished: list[tuple[torch.futures.Future, Callable[[torch.futures.Future], None]]] = []
        """dense steps' all_reduces (the collective's future, what completes the call) whose sum
        `finish_step` turns into the result, on the thread that waits for the step"""
        self._uncompressed: dict[str, dict[str, Any]] = {}
        """per tensor sent uncompressed: the feedback's state for `Feedback.update_uncompressed`"""
        self._row_errors: dict[str, torch.Tensor] = {}
        """per sparse gradient sent in a lossy value format: each entry's rounding error, flat, added
        to the entry the next time its row is sent (`_rows_rounded`)"""
        self._layouts: dict[str, list[str]] = {}
        """per set of parameters sharing a DDP bucket: the parameter order it was last reduced in"""
        self._restored_layouts: dict[str, list[str]] = {}
        """layouts from a checkpoint that DDP has not yet come back to (see `_reduction_order`)"""
        self._wires: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        """per stream and wire dtype: the buffer its dense steps send when they cannot send the
        gradient's own (fp16, or with a report's tail); scratch, not checkpointed"""
        self._bucket_layouts: dict[tuple, tuple[str, str, list[Segment]]] = {}
        """per DDP bucket as DDP lays it out (index, buffer, parameters): its key, stats key and
        segments, worked out once (derived, so not checkpointed)"""
        sparsifier = self.spec.sparsifier
        self.budget = (LinkBudget(sparsifier, self.world_size, self.spec.feedback.delay_horizon())
                       if isinstance(sparsifier, Adaptive) else None)
        """the adaptive sparsifier's byte budget (None for other pipelines)"""
        self._plan: Plan | None = None
        """this step's plan while a step is open (the adaptive pipeline), else None"""
        self._forward_start: float | None = None
        """when the model's first forward pass since the last step began (the budget's compute clock)"""
        self._forward_hook = (module.register_forward_pre_hook(self._forward_started)
                              if self.budget is not None and module is not None else None)
        agree(group, Request(key="GradientReducer configuration"), self.world_size,
              fingerprint(format_spec(self.spec), seed, nonfinite, dense_below, average))
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self.async_group = dist.new_group(ranks=ranks)
        self._process_group = self.async_group if self.async_group is not None else _default_group()
        self.wire_device = wire_device(self._process_group)
        """where this reducer's collectives take their tensors (`wire_device`)"""
        self._rank = dist.get_rank(self._process_group)
        self._reports = BudgetReports(self.async_group, self.wire_device)
        """the budget's reports on their way to every rank"""
        if self.world_size > 1:  # groups its calls need, made now with the others rather than in a step
            self.spec.transport.prepare(self.async_group, self.session)
        if self.budget is not None and module is not None:  # its size, before the first step measures it
            self.budget.total_numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if self.budget is not None and self.world_size > 1 and not self.budget.sparsifier.budget:
            # the sparse path's and the link's costs, timed before the first step, so that step can be planned
            self.budget.calibrate(self.spec)
            model_numel = sum(p.numel() for p in module.parameters()) if module is not None else None
            self.budget.observe_link(*link_throughput(self.async_group, probe_numel(model_numel), self.wire_device,
                                                      (torch.float32, torch.float16)))

    def __repr__(self) -> str:
        return f"GradientReducer({format_spec(self.spec)!r}, world_size={self.world_size}, seed={self.seed})"

    def check_matches(self, spec: str | PipelineSpec, seed: int, nonfinite: str, dense_below: int) -> None:
        """Raise unless this reducer was built with these arguments."""
        asked = (format_spec(resolve(spec)), seed, nonfinite, dense_below)
        mine = (format_spec(self.spec), self.seed, self.nonfinite, self.dense_below)
        if asked != mine:
            raise SparseCommError(f"the state passed is a reducer for (spec, seed, nonfinite, dense_below) = {mine}, "
                                  f"but the call asks for {asked}; build a new reducer to change them")

    # -- custom loops -------------------------------------------------------------------------
    def allreduce_(self, named_gradients: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One step of a custom loop: replace each gradient by its average over ranks (dense in
        place; sparse COO by ``copy_``). Tensors are matched across ranks by name — every rank must
        pass the same names, in any order, or every rank raises `SparseCommError`."""
        named = sorted(named_gradients, key=lambda item: item[0])
        names = [name for name, _ in named]
        if len(set(names)) != len(names):
            raise SparseCommError(f"gradient names repeat: {sorted({n for n in names if names.count(n) > 1})}")
        agree(self.group, Request(key="gradients " + ", ".join(names), call=self.stats.steps), len(names), 0)
        pending = [(tensor, self._submit(name, tensor, None, synchronous=i == len(named) - 1))
                   for i, (name, tensor) in enumerate(named)]
        self.finish_step()
        for tensor, future in pending:
            averaged = future.wait()
            if averaged is not tensor:
                tensor.copy_(averaged)

    def finish_step(self) -> None:
        """Wait for this step's calls, count the step, and raise the first error any call met.

        Dense steps' sums on a CPU are averaged, checked and handed to the feedback's momentum here,
        in the order they were posted, by the thread that waits for the step anyway — not in
        callbacks on gloo's threads, where that Python holds the interpreter and the processor
        while later buckets' collectives are still in flight."""
        if self._deferred:  # no synchronous call took them (a dense step's last bucket, a resumed run's reordered one)
            self.session.drain()
            self._exchange_deferred()
        unfinished, self._unfinished = self._unfinished, []
        for done, finish in unfinished:
            with contextlib.suppress(Exception):  # a failed collective: finish hands its error to the result
                wait_polling(done)
            finish(done)
        in_flight, self._in_flight = self._in_flight, []
        errors = []
        for future in in_flight:
            try:
                future.wait()
            except BaseException as err:  # noqa: BLE001 - raised below, after every call ended
                errors.append(err)
        if self.budget is not None and self._plan is not None:
            self.pipeline.share_density()
            step = self.budget.step
            self._reports.end_step(step, self.budget.end_step(), self._report_needed(),
                                   first=self.budget.reports_read == 0)
        self._plan = None
        self.stats.steps += 1
        if errors:
            raise errors[0]

    # -- reducing -----------------------------------------------------------------------------
    def reduce(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The average over ranks of ``tensor`` (same shape and kind), synchronously."""
        future = self.reduce_async(key, tensor)
        self._in_flight.remove(future)
        return future.wait()

    def reduce_async(self, key: str, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Local stages now; the collective on the worker thread; a future of the average."""
        return self._submit(key, tensor, None, in_step=False)

    def reduce_bucket_async(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP bucket: its parameters' state found by name (see `ddp_comm_hook`). The step's last
        bucket is reduced on the calling thread, once the calls before it are done: nothing is left
        to overlap it with, and handing it to the worker thread would only add the handoff."""
        buffer = bucket.buffer()
        parameters = bucket.parameters()
        where = 0 if buffer.is_sparse else buffer.data_ptr()  # a sparse bucket is one parameter, no storage
        signature = (bucket.index(), where, buffer.numel(), buffer.is_sparse, tuple(map(id, parameters)))
        known = self._bucket_layouts.get(signature)
        if known is not None:  # as it was last step: DDP keeps a bucket's layout until it rebuilds
            key, stats_key, segments = known
            return self._submit(key, buffer, segments, stats_key=stats_key, synchronous=bucket.is_last())
        if not self._names:
            raise SparseCommError("a GradientReducer used as a DDP hook state needs model= (its parameter names key "
                                  "each parameter's residual and momentum)")
        names = []
        for parameter in parameters:
            if id(parameter) not in self._names:
                raise SparseCommError(f"a DDP bucket holds a parameter of shape {tuple(parameter.shape)} that is not "
                                      "in the model given to the GradientReducer")
            names.append(self._names[id(parameter)])
        order = self._reduction_order(names)
        layout = zlib.crc32("\0".join(order).encode())
        key = f"bucket {bucket.index()} [{order[0]} … {order[-1]}, {len(order)} parameters, layout {layout:08x}]"
        if buffer.is_sparse:
            segments = [Segment(names[0], 0, buffer.numel())]
            self._bucket_layouts[signature] = (key, names[0], segments)
            return self._submit(key, buffer, segments, stats_key=names[0], synchronous=bucket.is_last())
        stats_key = f"bucket{bucket.index()}"
        gradients = dict(zip(names, bucket.gradients(), strict=True))
        offsets = {name: (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
                   for name, grad in gradients.items()}
        if order == names:
            segments = [Segment(name, offsets[name], grad.numel(), whole=grad.numel() < self.dense_below)
                        for name, grad in gradients.items()]
            self._bucket_layouts[signature] = (key, stats_key, segments)
            return self._submit(key, buffer, segments, stats_key=stats_key, synchronous=bucket.is_last())
        # the first step of a fresh DDP after a resume: reduce in the checkpoint's layout, return in DDP's
        reordered = torch.cat([gradients[name].reshape(-1) for name in order])
        segments, start = [], 0
        for name in order:
            numel = gradients[name].numel()
            segments.append(Segment(name, start, numel, whole=numel < self.dense_below))
            start += numel
        reduced = self._submit(key, reordered, segments, stats_key=stats_key)
        result = _result_future(buffer)

        def back_to_ddp_layout(done: torch.futures.Future[torch.Tensor]) -> None:
            try:
                total = done.wait()
                in_ddp_layout = torch.empty_like(buffer)
                for segment in segments:
                    offset = offsets[segment.key]
                    in_ddp_layout[offset:offset + segment.numel] = total[segment.start:segment.start + segment.numel]
                result.set_result(in_ddp_layout)
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                result.set_exception(err)

        reduced.add_done_callback(back_to_ddp_layout)
        self._in_flight[-1] = result  # finish_step waits for the copy back too
        return result

    def _reduction_order(self, names: list[str]) -> list[str]:
        """The order to reduce a bucket's parameters in. Normally DDP's own. A fresh DDP (as after a
        resume) runs its first step on its initial layout before rebuilding; a dense all_reduce at 3+
        ranks rounds each sum by position, so until DDP's layout matches the one in the checkpoint
        again, the bucket is reduced in the checkpoint's layout."""
        members = f"{zlib.crc32(chr(0).join(sorted(names)).encode()):08x}"
        restored = self._restored_layouts.get(members)
        if restored is not None and restored != names:
            return restored
        self._restored_layouts.pop(members, None)
        self._layouts[members] = names
        return names

    def _submit(self, key: str, tensor: torch.Tensor, segments: list[Segment] | None,
                stats_key: str | None = None, synchronous: bool = False,
                in_step: bool = True) -> torch.futures.Future[torch.Tensor]:
        """One call's local stages and collective; a future of its average. ``in_step``: the caller
        completes the step with `finish_step` (DDP's buckets, `allreduce_`), which then finishes a
        dense step's sum on a CPU (`_submit_native`); not so a lone `reduce_async`."""
        stats = self.stats.tensors.setdefault(stats_key or key, TensorStats())
        stats.steps += 1
        stats.dense_bytes += tensor.numel() * 4
        start = time.perf_counter()
        if self.budget is not None and self._plan is None:
            self._begin_budget_step(start)
        if self.budget is not None and self.budget.measuring.wants_energy and self._under_budget(tensor):
            flat = tensor.reshape(-1)
            self.budget.sample_energy(flat, [(s.start, s.numel) for s in segments if not s.whole] if segments
                                      else [(0, flat.numel())])
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        if self._plan is not None and self._plan.dense and not tensor.is_sparse:
            return self._submit_native(key, tensor, segments, stats, start, in_step)
        side = self._reports.take()  # rides on the agreement step (None: no adaptive budget, or taken)
        request = Request(key=key, call=call, seed=self.seed, step=self.stats.steps,
                          index_codec=self.spec.index_codec, value_codec=self.spec.value_codec, side=side or ())
        transport, contribution, request, path = self._prepare(key, tensor, segments, request)
        stats.path = path
        submitted = time.perf_counter()
        stats.select_s += submitted - start
        if self.budget is not None:
            self._measure_submit(tensor, segments, path, submitted - start, submitted)
        # the sum lands in the gradient's own storage: the local stages above already copied what they use
        out = tensor if not tensor.is_sparse and tensor.is_contiguous() else None
        this_call = FusedCall(contribution, request, out)
        fuses = in_step and isinstance(transport, AllgatherTransport) and FUSE_BELOW > 0  # with others, one exchange
        waits = fuses and (path == "sparse" or self._expected_entries(tensor, segments, path) < FUSE_BELOW)
        future: torch.futures.Future
        if synchronous:  # on this thread, after the worker thread's calls (collectives stay in order)
            self.session.drain()
            if fuses:  # the step's last call carries those that waited for it
                future = self._exchange_deferred(this_call)
            else:
                self._exchange_deferred()
                future = torch.futures.Future()
                try:
                    future.set_result(transport.reduce(contribution, self.async_group, request, out, self.session))
                except BaseException as err:  # noqa: BLE001 - handed to the waiter, as an asynchronous call's
                    future.set_exception(err)
        elif waits:  # for the step's last call
            future = torch.futures.Future()
            self._deferred.append((this_call, future))
        else:
            future = transport.reduce_async(contribution, self.async_group, request, out, self.session)
        result = _result_future(tensor)

        def finish(done: torch.futures.Future[Reduction]) -> None:
            # not Future.then: it would wrap a SparseCommError in a RuntimeError
            try:
                reduction = done.wait()
                stats.transport_s += time.perf_counter() - submitted
                if side is not None:
                    agreement = reduction.record.agreement
                    self._reports.carried(agreement.sides if agreement is not None else None)
                if self.budget is not None:
                    self._measure_done(path, reduction.record.bytes_sent, contribution)
                stats.decode_s += reduction.record.decode_s
                stats.bytes_sent += reduction.record.bytes_sent
                total = reduction.total
                if self.average:
                    total = total.div_(self.world_size) if out is not None and total is out else total / self.world_size
                total = self._update_uncompressed(total, key, segments, whole_only=path == "compressed")
                if tensor.is_sparse:
                    result.set_result(nonzero_rows(total, tensor.sparse_dim()))
                else:
                    result.set_result(total.reshape(tensor.shape).to(tensor.dtype))
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                result.set_exception(err)

        future.add_done_callback(finish)
        self._in_flight.append(result)
        return result

    def _submit_native(self, key: str, tensor: torch.Tensor, segments: list[Segment] | None, stats: TensorStats,
                       start: float, in_step: bool) -> torch.futures.Future[torch.Tensor]:
        """A dense step of the adaptive pipeline, run as DDP's own hooks run a bucket: each tensor's
        feedback flushed into it (in fp16 scaled by 1/P on a ``half`` step), then one asynchronous
        all_reduce — no agreement step, no worker thread — and, once the sum is in, what the
        feedback owns applied to the average (`Pipeline.update_flushed`: DGC's momentum). A rank
        whose gradient is non-finite under ``nonfinite="raise"`` sends NaN (or its gradient as it
        is), so every rank sums to a non-finite total and raises together."""
        assert self.budget is not None
        # a report travels in a scratch wire, which costs passes over the bucket: only one the budget must hear
        side = self._reports.take(needed_only=True)
        wire = self._native_wire(key, tensor, segments, side)
        stats.path = wire.path
        submitted = time.perf_counter()
        stats.select_s += submitted - start
        self._measure_submit(tensor, segments, wire.path, submitted - start, submitted)
        if self.budget.measuring.first_issue is None:
            self.budget.measuring.first_issue = submitted
        # posted on the process group itself, as DDP posts its own: dist.all_reduce's checks cost more.
        # A CUDA tensor goes as it is, on gloo too: gloo stages it through pinned memory on its own
        # stream and thread, where a copy to the wire device here would hold up the backward pass
        posted = wire.tensor if wire.tensor.device.type == "cuda" else on_wire(wire.tensor, self.wire_device)
        work = self._process_group.allreduce([posted])
        result = _result_future(tensor)

        def finish(done: torch.futures.Future) -> None:
            try:
                total = done.value()[0].to(tensor.device)  # itself, unless gloo carried a CUDA gradient
                if wire.carrying is not None:
                    self._reports.carried(read_tail(total[wire.carrying:]))
                    total = total[:wire.carrying]
                stats.transport_s += time.perf_counter() - submitted
                stats.bytes_sent += wire.nbytes
                self._measure_done(wire.path, wire.nbytes, None)
                if not all_finite(total):
                    raise SparseCommError(f"a rank had a non-finite gradient (NaN or Inf) in {key!r}, or the sum "
                                          "overflowed; no rank applied it")
                if wire.path == "half":  # already scaled to the average: back to the gradient's buffer and units
                    total = wire.home.copy_(total)
                    if not self.average:
                        total.mul_(self.world_size)
                elif wire.carrying is not None:  # back to the gradient's buffer: the wire is scratch
                    total = wire.home.copy_(total)
                    total = total.div_(self.world_size) if self.average else total
                elif self.average:
                    total = total.div_(self.world_size)
                if wire.path in ("flush", "half"):  # what the feedback owns follows the average (DGC's momentum)
                    self.pipeline.update_flushed(total, key, segments)
                total = self._update_uncompressed(total, key, segments, whole_only=wire.path in ("flush", "half"))
                result.set_result(total.reshape(tensor.shape).to(tensor.dtype))
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                result.set_exception(err)

        # finished by `finish_step`, on the thread waiting for the step; a CUDA sum keeps c10d's
        # callback, on the stream its work ended on (checked on a GPU that way; not yet this way)
        if in_step and tensor.device.type == "cpu":
            self._unfinished.append((work.get_future(), finish))
        else:
            work.get_future().add_done_callback(finish)
        self._in_flight.append(result)
        return result

    def _native_wire(self, key: str, tensor: torch.Tensor, segments: list[Segment] | None,
                     side: tuple[float, ...] | None) -> NativeWire:
        """What a dense step sends for a dense ``tensor``: as it is (fp32) below ``dense_below``, else
        flushed from its feedback, in fp16 on a ``half`` step; with ``side`` (a budget report),
        followed by its tail (`sparsecomm.transport.side_numbers`). Under ``nonfinite="raise"`` the
        gradient is screened only where its state would need undoing (`Pipeline.flush`): a rank's
        NaN or Inf makes every rank's sum non-finite, and `_submit_native` raises on every rank."""
        assert self.budget is not None and self._plan is not None
        nonfinite = self.pipeline.nonfinite
        scale, carrying = 1.0, None
        home = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        half = self._plan.mode == HALF and not (segments is None and tensor.numel() < self.dense_below)
        # the gradient's own buffer is the wire unless the wire is fp16 or carries a tail
        full = self._wire_buffer(key, home, torch.float16 if half else home.dtype) if half or side else None
        sent = full[:home.numel()] if full is not None else home
        if segments is None and tensor.numel() < self.dense_below:  # no feedback: sent as it is
            screened, must_raise = (home, False) if nonfinite == "raise" else screen_nonfinite(home, nonfinite)
            if screened is None:
                sent.zero_()
            elif screened is not sent:
                sent.copy_(screened)
            path = "dense"
        elif half:
            scale = 1.0 / self.world_size  # as DDP's fp16 hook: the sum of P values stays in range
            sent, must_raise = self.pipeline.flush(home, key, segments, out=sent, scale=scale, sum_checked=True)
            path = "half"
        else:
            sent, must_raise = self.pipeline.flush(home, key, segments, out=sent, sum_checked=True)
            path = "flush"
        wire = sent
        if side is not None:  # then full is the wire buffer
            assert full is not None
            write_tail(full[home.numel():], side, self._rank)
            wire, carrying = full, home.numel()
        nbytes = wire.numel() * wire.element_size()
        if must_raise:
            sent.fill_(math.nan)
        elif sent.numel() and self._report_needed():
            low, high = (float(bound) for bound in torch.aminmax(sent))
            if math.isfinite(low) and math.isfinite(high):  # else the sum is non-finite: every rank raises
                measuring = self.budget.measuring
                measuring.max_magnitude = max(measuring.max_magnitude, max(-low, high) / scale)
        return NativeWire(wire, path, nbytes, home, carrying)

    def _wire_buffer(self, key: str, home: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stream's reusable wire of ``dtype``: room for the gradient and a report's tail."""
        numel = home.numel() + tail_elements(self.world_size)
        buffer = self._wires.get((key, dtype))
        if buffer is None or buffer.numel() != numel or buffer.device != home.device:
            buffer = self._wires[(key, dtype)] = torch.empty(numel, dtype=dtype, device=home.device)
        return buffer

    def _report_needed(self) -> bool:
        """Whether this step's report must be heard even at the cost of an all_reduce of its own
        (when no call of the next step can carry it): every step at first, then every few — and
        every step whose mode differs from the step before's or that belongs to a trial, or a
        trial's samples would be lost. Also when this step measures the largest magnitude sent."""
        return (self.stats.steps < EVERY_STEP_REPORTS or self.stats.steps % REPORT_EVERY == 0
                or (self.budget is not None and (self.budget.switched or self.budget.trial is not None)))

    def _begin_budget_step(self, now: float) -> None:
        """Learn the ranks' reports from two steps back (`BudgetReports.ready`; the very first at
        once, so that the second step already has numbers) and plan this step."""
        assert self.budget is not None
        for step, agreed in self._reports.ready(self.budget.step, first=self.budget.reports_read == 0):
            self.budget.observe(agreed, step)
        self._plan = self.budget.begin_step(now, self._forward_start)
        self._forward_start = None

    def _forward_started(self, module: nn.Module, inputs: Any) -> None:
        """The model's forward pre-hook: the first forward pass since the last step starts the clock."""
        if self._forward_start is None and self._plan is None:
            self._forward_start = time.perf_counter()

    def _update_uncompressed(self, total: torch.Tensor, key: str, segments: list[Segment] | None,
                             whole_only: bool) -> torch.Tensor:
        """What the feedback owns for tensors sent without it (all of them, or a compressed
        bucket's whole-sent parameters), applied to their averages."""
        feedback = self.spec.feedback
        if segments is None:
            return total if whole_only else feedback.update_uncompressed(total, self._uncompressed.setdefault(key, {}))
        flat = total.view(-1)
        chosen = [segment for segment in segments if segment.whole or not whole_only]
        if chosen:
            feedback.update_uncompressed_([flat[s.start:s.start + s.numel] for s in chosen],
                                          [self._uncompressed.setdefault(s.key, {}) for s in chosen])
        return total

    def _prepare(self, key: str, tensor: torch.Tensor, segments: list[Segment] | None,
                 request: Request) -> tuple[Transport, SparseGradient | torch.Tensor, Request, str]:
        """(transport, this rank's contribution, the request, the path taken) for one call."""
        if tensor.is_sparse:  # rows: an exact transport; exact codecs, or a rounding whose error is held
            transport = self.spec.transport
            if not transport.exact or transport.name == "dense":
                transport = AllgatherTransport()
            sparse = SparseGradient.from_sparse_coo(tensor.detach())
            values, nonfinite = screen_nonfinite(sparse.values, self.pipeline.nonfinite)
            given_index, given_value = codecs_of(request)
            exact = self._plan is not None and self._plan.dense  # a dense step sends every row exactly, and cheaply
            index_codec, value_codec = (raw_codecs(sparse.dtype, math.prod(sparse.shape)) if exact
                                        else exact_codecs(given_index, given_value, sparse.dtype))
            rounds = (not exact and value_codec is not given_value
                      and given_value.as_decoded(sparse.values[:0]) is not None)
            # decided from the dtype, the spec and the agreed plan alone, so every rank's configuration is alike
            request = replace(request, nonfinite=nonfinite, index_codec=index_codec,
                              value_codec=given_value if rounds else value_codec)
            nothing = SparseGradient(sparse.indices[:0], sparse.values[:0], sparse.shape)
            if values is None:
                return transport, nothing, request, "sparse"
            if not rounds:
                errors = self._row_errors.get(parameter_of(key, segments)) if exact else None
                if errors is not None:  # the rows' held rounding errors go with them, and are gone
                    values = values + errors[sparse.indices]
                    errors[sparse.indices] = 0
                return transport, SparseGradient(sparse.indices, values, sparse.shape), request, "sparse"
            try:
                received, payload = self._rows_rounded(parameter_of(key, segments), tensor,
                                                       SparseGradient(sparse.indices, values, sparse.shape), request)
            except SparseCommError as refused:  # beyond the format's range: every rank raises
                return transport, nothing, replace(request, refused=str(refused)), "sparse"
            return transport, received, replace(request, payload=payload, payload_is_contribution=True), "sparse"
        if not self._under_budget(tensor):
            screened, nonfinite = screen_nonfinite(tensor.detach(), self.pipeline.nonfinite)
            dense = screened if screened is not None else torch.zeros_like(tensor)
            transport = self.spec.transport if self.spec.transport.name == "dense" else DenseTransport()
            return transport, dense, replace(request, nonfinite=nonfinite), "dense"
        density = self._plan.density if self._plan is not None else None
        stepped = tensor.reshape(-1) if segments else tensor
        try:
            output = self.pipeline.step(stepped, key, segments=segments, density=density)
        except SparseCommError as refused:  # a codec that cannot carry these values (fp16's range): all raise
            nothing = SparseGradient(torch.zeros(0, dtype=torch.int64, device=tensor.device),
                                     torch.zeros(0, dtype=tensor.dtype, device=tensor.device), stepped.shape)
            return self.spec.transport, nothing, replace(request, refused=str(refused)), "compressed"
        request = replace(request, nonfinite=output.nonfinite, payload=output.payload, payload_is_contribution=True)
        return self.spec.transport, output.selection, request, "compressed"

    def _rows_rounded(self, name: str, tensor: torch.Tensor, rows: SparseGradient,
                      request: Request) -> tuple[SparseGradient, bytes]:
        """A sparse gradient's ``rows`` in the request's lossy value format, a deterministic rounding
        (int8, fp16, bf16): (what receivers will decode, the payload). Each entry's values go with
        the error it was last sent with, and the new error is held per entry (``_row_errors``, one
        float per entry of the tensor) until its row is sent again. A value the format cannot carry
        raises `SparseCommError` and changes nothing."""
        assert request.index_codec is not None and request.value_codec is not None
        errors = self._row_errors.get(name)
        sent = rows.values if errors is None else rows.values + errors[rows.indices]
        received = request.value_codec.as_decoded(sent)
        assert received is not None
        payload = encode(SparseGradient(rows.indices, sent, rows.shape), request.index_codec, request.value_codec,
                         rng=request.rng(self._rank))
        if errors is None:
            errors = self._row_errors[name] = torch.zeros(tensor.numel(), dtype=sent.dtype, device=sent.device)
        errors[rows.indices] = sent - received
        return SparseGradient(rows.indices, received, rows.shape), payload

    def _under_budget(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor goes through the pipeline (compressed, or flushed on a dense
        step) rather than by plain all_reduce."""
        return not tensor.is_sparse and tensor.numel() >= self.dense_below and self.spec.transport.name != "dense"

    def _expected_entries(self, tensor: torch.Tensor, segments: list[Segment] | None, path: str) -> int:
        """How many entries a call is expected to send, from what every rank knows alike (sizes,
        the sparsifier's target, this step's agreed density), so that every rank defers the same
        calls: a call outside the pipeline counts all its entries, a sparsifier with no target too."""
        if path != "compressed":
            return tensor.numel()
        sparsifier = self.spec.sparsifier if self._plan is None else self.pipeline.at_density(self._plan.density)
        sizes = [(s.numel, s.whole) for s in segments] if segments else [(tensor.numel(), False)]
        targets = [None if whole else sparsifier.target_count(numel) for numel, whole in sizes]
        return sum(numel if target is None else target for (numel, _), target in zip(sizes, targets, strict=True))

    def _exchange_deferred(self, last: FusedCall | None = None) -> torch.futures.Future:
        """On this thread (the worker thread drained): the deferred calls, and ``last``, in one
        exchange, each call's future set; ``last``'s future (without ``last``, an unused one)."""
        deferred, self._deferred = self._deferred, []
        last_future: torch.futures.Future = torch.futures.Future()
        if last is not None:
            deferred.append((last, last_future))
        if deferred:
            try:
                reductions = AllgatherTransport().reduce_fused([call for call, _ in deferred], self.async_group,
                                                               self.session)
            except BaseException as err:  # noqa: BLE001 - handed to every waiter
                for _, future in deferred:
                    future.set_exception(err)
            else:
                for (_, future), reduction in zip(deferred, reductions, strict=True):
                    future.set_result(reduction)
        return last_future

    # -- the adaptive pipeline's measurements ---------------------------------------------------
    def _measure_submit(self, tensor: torch.Tensor, segments: list[Segment] | None, path: str, local_s: float,
                        now: float) -> None:
        """A call's share of the step: its size, what the budget covers, its local stages."""
        assert self.budget is not None
        measuring = self.budget.measuring
        measuring.local_s += local_s
        measuring.last_submit = now
        measuring.total_numel += tensor.numel()
        if path in ("compressed", "flush", "half"):
            measuring.budget_numel += sum(s.numel for s in segments if not s.whole) if segments else tensor.numel()
        if path == "compressed" and self._plan is not None:
            planned = self.pipeline.at_density(self._plan.density)
            measuring.planned_nnz += sum(planned.target_count(s.numel) for s in segments if not s.whole) if segments \
                else planned.target_count(tensor.numel())
        if path == "compressed" and segments:
            measuring.whole_nnz += sum(last.selected for s in segments if s.whole
                                       and (last := self.pipeline.states[s.key].last) is not None)

    def _measure_done(self, path: str, nbytes: int, contribution: SparseGradient | torch.Tensor | None) -> None:
        """A finished call's bytes and, for a large dense all_reduce, the link's throughput."""
        assert self.budget is not None
        measuring = self.budget.measuring
        now = time.perf_counter()
        measuring.last_done = max(measuring.last_done, now)
        if path == "compressed":
            measuring.payload_bytes += nbytes
            if isinstance(contribution, SparseGradient) and contribution.nnz:
                measuring.payload_nnz += contribution.nnz
                if self._report_needed():
                    low, high = torch.aminmax(contribution.values)
                    measuring.max_magnitude = max(measuring.max_magnitude, -float(low), float(high))
        elif path not in ("flush", "half"):
            measuring.fixed_bytes += nbytes
        if path in ("dense", "flush", "half") and nbytes >= MIN_WIRE_BYTES and measuring.first_issue is not None:
            measuring.wire_bytes += 2 * (self.world_size - 1) / self.world_size * nbytes
            measuring.wire_s = now - measuring.first_issue

    # -- lifetime and checkpoints ---------------------------------------------------------------
    def close(self) -> None:
        """Wait for calls in flight, stop the worker thread and unhook the model."""
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._reports.close()
        self.session.close()

    def __enter__(self) -> GradientReducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit: per-parameter (per-tensor)
        pipeline and feedback state by name, call counters, steps and auto's measurements."""
        return {"pipeline": self.pipeline.state_dict(), "calls": dict(self._calls), "steps": self.stats.steps,
                "uncompressed": {key: {name: value.clone() for name, value in state.items()}
                                 for key, state in self._uncompressed.items()},
                "session": self.session.state_dict(), "layouts": {k: list(v) for k, v in self._layouts.items()},
                "row_errors": {key: errors.clone() for key, errors in self._row_errors.items()},
                "budget": self.budget.state_dict() if self.budget is not None else None,
                "reports": self._reports.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipeline.load_state_dict(state["pipeline"])
        self._calls = dict(state["calls"])
        self.stats.steps = state["steps"]
        self._uncompressed = {key: {name: value.clone() for name, value in saved.items()}
                              for key, saved in state["uncompressed"].items()}
        self.session.load_state_dict(state["session"])
        self._row_errors = {key: errors.clone() for key, errors in state.get("row_errors", {}).items()}
        self._layouts = {key: list(names) for key, names in state.get("layouts", {}).items()}
        self._bucket_layouts = {}  # the checkpoint's layouts decide the next bucket's order
        if self.budget is not None and state.get("budget") is not None:
            self.budget.load_state_dict(state["budget"])
            reports = state["reports"]
            # a checkpoint from before reports rode on calls holds the agreed ones alone
            self._reports.load_state_dict({"agreed": reports} if isinstance(reports, list) else reports)
        self._restored_layouts = {key: list(names) for key, names in self._layouts.items()}
