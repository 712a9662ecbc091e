"""``auto``: the exact transport that is fastest for this call's size — dense all_reduce, payload
allgather, or one of SparCML's sparse allreduce algorithms — and, where the caller's error feedback
keeps what a transport loses, also SparCML's split-allgather keeping a global top-k (``topk_sa``),
whose bytes per rank stay bounded as the ranks grow.

The α-β cost model (`sparsecomm.transport.cost_model`) ranks them from N, the largest nnz on any
rank, P and the measured codec speed, and shortlists those predicted within ``shortlist`` × the
best (at most three). With ``explore`` > 0, the first calls of each size class (N, nnz to half an
octave, P) run each shortlisted transport ``explore`` times, timing the slowest rank, and every
later call uses the one with the lowest median time (a spike in a few trials does not move it, and
it is the steady-state figure a training loop sees); the two best, when their medians are within
15% or their trials overlap (`Tuning`), run on to five times as many trials first, and within 5%
the model's ranking stands. The model narrows the field, measurement decides. With ``explore=0``
the model's first choice is used directly, and so it is without a `TransportSession`: what auto
measures lives in the session passed to the call, whose owner checkpoints it, so a resumed run
makes the same choices. All ranks
decide from agreed numbers (maxima over ranks) and a cost model checked to be the same, so they
always choose alike.

auto's agreement step stands in for the chosen transport's, so auto costs no collective more than
the transport it picks. When the call is expected to run ``allgather`` (its size class chose it, or
tries it next), the payload is encoded first; with a session on gloo, auto then runs allgather's one
round, its configuration in the agreement records that travel in front of the payloads, and the
largest nnz they bring decides what the size class runs next. Elsewhere the agreement step carries
the payload sizes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
import torch.distributed as dist

from sparsecomm.encode.base import codecs_lossless
from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.encode.value.floats import Float32Values
from sparsecomm.errors import SparseCommError
from sparsecomm.finite import all_finite
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.allgather import AllgatherTransport, codecs_of, payload_or_refusal
from sparsecomm.transport.base import TRANSPORTS, Transport, as_sparse, refused_unless_out_fits
from sparsecomm.transport.collectives import Group, fingerprint, takes_short_messages, wire_device, world
from sparsecomm.transport.cost_model import CostModel, load_cost_model
from sparsecomm.transport.dense import DenseTransport
from sparsecomm.transport.request import CallRecord, Reduction, Request
from sparsecomm.transport.session import TransportSession
from sparsecomm.transport.sparse_allreduce import SparseAllreduce, split_points_of
from sparsecomm.transport.tuning import TIE_BREAK_TRIALS, Tuning

VALUE_BYTES = MappingProxyType({"fp32": 4.0, "fp16": 2.0, "bf16": 2.0})
MAX_SHORTLIST = 3


def estimated_payload_bytes_per_nnz(request: Request, numel: int, nnz: int) -> float:
    """A cheap size estimate for the pipeline's codecs (gap codes: about log2(N/k) + 1.5 bits)."""
    index_name = (request.index_codec or RiceIndices()).name
    value_name = (request.value_codec or Float32Values()).name
    gap_bytes = (math.log2(max(1.0, numel / max(nnz, 1))) + 1.5) / 8
    index_bytes = {"raw": 4.0, "bitmap": numel / 8 / max(nnz, 1)}.get(index_name, gap_bytes)
    return index_bytes + VALUE_BYTES.get(value_name, 4.0)


GLOBAL_TOP_K = "sparse_allreduce(algorithm=topk_sa)"


def predicted_costs(model: CostModel, workers: int, numel: int, nnz: int, isize: int,
                    payload_bytes_per_nnz: float, global_top_k: bool = False) -> dict[str, float]:
    """Predicted seconds of every exact transport, keyed by its spec, and with ``global_top_k``
    also of `GLOBAL_TOP_K`'s."""
    costs = {"dense": model.dense(workers, numel, isize),
             "allgather": model.allgather(workers, numel, nnz, payload_bytes_per_nnz)}
    for algorithm, cost in model.sparse_algorithms(workers, numel, nnz, isize).items():
        costs[f"sparse_allreduce(algorithm={algorithm})"] = cost
    if global_top_k:
        costs[GLOBAL_TOP_K] = model.split_allgather(workers, numel, nnz, isize, keep=True)
    return costs


def choose(model: CostModel, workers: int, numel: int, nnz: int, isize: int, request: Request,
           global_top_k: bool = False) -> tuple[str, dict[str, float]]:
    """The model's first choice and all its predictions, for payloads of ``request``'s codecs."""
    costs = predicted_costs(model, workers, numel, nnz, isize, estimated_payload_bytes_per_nnz(request, numel, nnz),
                            global_top_k)
    return min(costs, key=costs.__getitem__), costs


def size_class(numel: int, nnz: int, isize: int, workers: int, settings: tuple) -> tuple:
    return (numel, round(2 * math.log2(nnz + 1)), isize, workers, settings)


def build(name: str) -> Transport:
    if name == "dense":
        return DenseTransport()
    if name == "allgather":
        return AllgatherTransport()
    return SparseAllreduce(algorithm=name.split("=")[1].rstrip(")"))


def _screened(sparse: SparseGradient) -> tuple[bool, str]:
    """Whether ``sparse`` holds a non-finite value, and why its indices make no sparse gradient
    ("": they do, `SparseGradient.validate`)."""
    try:
        sparse.validate()
    except SparseCommError as unsound:
        return not all_finite(sparse.values), str(unsound)
    return not all_finite(sparse.values), ""


@TRANSPORTS.register("auto")
@dataclass(frozen=True)
class AutoTransport(Transport):
    explore: int = 5
    """timed trials per shortlisted transport in each size class (0: trust the model)"""
    shortlist: float = 3.0
    """keep candidates predicted within this factor of the best"""
    global_top_k: bool = True
    """where the caller's error feedback keeps what a transport loses (``Request.keeps_lost``), also
    weigh `GLOBAL_TOP_K`: its sum keeps the largest entries, the rest goes back to the feedback"""

    def __post_init__(self) -> None:
        if self.explore < 0 or self.shortlist < 1.0:
            raise SparseCommError("auto needs explore >= 0 and shortlist >= 1")

    def prepare(self, group: Group, session: TransportSession) -> None:
        """What allgather needs, the transport most small calls run."""
        AllgatherTransport().prepare(group, session)

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        start = time.perf_counter()
        sparse = as_sparse(grad)
        request = request or Request()
        _, workers = world(group)
        lossy = self.global_top_k and request.keeps_lost  # the same on every rank: it follows the spec
        model = session.cost_model if session is not None else load_cost_model()
        isize = sparse.values.element_size()
        stream = (sparse.numel, isize, workers, self.to_spec())
        expected = session.expected.get(stream) if session is not None else None  # what the size class runs next
        own = CallRecord()  # auto's own phases, added to the chosen transport's
        with own.phase("encode"):
            # sparse transports sort the indices before their agreement step, so auto sorts first too
            if expected != "dense":
                sparse = sparse.sorted()
            # Likewise allgather encodes before its agreement step, which then carries the payload
            # sizes: allgather needs no size exchange of its own. Codecs that may refuse these values
            # (lossy for their dtype: fp16's range) encode before the agreement step whatever runs
            # next, so that a refusal raises on every rank there (`payload_or_refusal`)
            if expected == "allgather" or not codecs_lossless(*codecs_of(request), sparse.dtype):
                payload, request = payload_or_refusal(sparse.sorted(), group, request)
                request = replace(request, payload=payload)
            elif request.payload is None and not (request.nonfinite or request.refused):
                # what the transport chosen after the agreement step would refuse alone (allgather's
                # codecs, a dense sum's scatter), refused on every rank at it instead
                nonfinite, unsound = _screened(sparse)
                request = replace(request, nonfinite=nonfinite, refused=unsound)
        config = fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype, model.fingerprint(),
                             split_points_of(session, request, sparse.numel, workers))
        if expected == "allgather" and session is not None and takes_short_messages(group):
            reduction, upcoming, costs = self._allgather_in_one_round(sparse, group, request, out, session, config,
                                                                      workers, isize, start, lossy)
        else:
            nbytes = len(request.payload) if request.payload is not None else 0
            # the transport it then runs takes this step's outcome: a wrong out is refused here
            request = refused_unless_out_fits(request, out, sparse.numel, sparse.dtype)
            with own.phase("agreement"):
                agreement = agree(group, request, sparse.numel, config, sparse.nnz, nbytes)
            best, costs = choose(model, workers, sparse.numel, agreement.max_nnz, isize, request, lossy)
            request = replace(request, agreement=agreement)  # the chosen transport needs no agreement step
            if session is None or self.explore == 0:
                reduction, upcoming = build(best).reduce(sparse, group, request, out, session), best
            else:
                reduction, upcoming = self._explore(sparse, group, request, out, session, best, costs, workers, isize,
                                                    start)
        if session is not None:
            session.expected[stream] = upcoming
        reduction.record.predicted_ms.update({name: 1e3 * cost for name, cost in costs.items()})
        for phase, seconds in own.phases.items():
            reduction.record.phases[phase] = reduction.record.phases.get(phase, 0.0) + seconds
        return reduction

    def _allgather_in_one_round(self, sparse: SparseGradient, group: Group, request: Request,
                                out: torch.Tensor | None, session: TransportSession, config: int, workers: int,
                                isize: int, start: float, lossy: bool) -> tuple[Reduction, str, dict[str, float]]:
        """``allgather`` in its one round, auto's configuration checked in its agreement records;
        the largest nnz they bring decides the size class's next call, and the call counts as one
        of its allgather trials where those are still wanted."""
        reduction = AllgatherTransport().reduce(sparse, group, replace(request, caller_config=config), out, session)
        assert reduction.record.agreement is not None
        max_nnz = reduction.record.agreement.max_nnz
        best, costs = choose(session.cost_model, workers, sparse.numel, max_nnz, isize, request, lossy)
        if self.explore == 0:
            return reduction, best, costs
        tuning = self._tuning(session, sparse.numel, max_nnz, isize, workers, best, costs)
        if tuning.wants("allgather", self.explore):
            tuning.record("allgather", slowest_seconds_since(start, group), self.explore)
        return reduction, tuning.chosen or tuning.next_to_try(self.explore) or "allgather", costs

    def _tuning(self, session: TransportSession, numel: int, max_nnz: int, isize: int, workers: int, best: str,
                costs: dict[str, float]) -> Tuning:
        """The size class's tuning, started with the model's shortlist."""
        key = size_class(numel, max_nnz, isize, workers, (self.explore, self.shortlist, GLOBAL_TOP_K in costs))
        if key not in session.tunings:
            ranked = sorted(costs, key=costs.__getitem__)
            shortlisted = [n for n in ranked if costs[n] <= self.shortlist * costs[best]]
            session.tunings[key] = Tuning(shortlisted[:MAX_SHORTLIST])
        return session.tunings[key]

    def _explore(self, sparse: SparseGradient, group: Group, request: Request, out: torch.Tensor | None,
                 session: TransportSession, best: str, costs: dict[str, float], workers: int, isize: int,
                 start: float) -> tuple[Reduction, str]:
        """The sum, by the size class's choice or its next trial, and what its next call will run."""
        assert request.agreement is not None
        tuning = self._tuning(session, sparse.numel, request.agreement.max_nnz, isize, workers, best, costs)
        if tuning.chosen is not None:
            return build(tuning.chosen).reduce(sparse, group, request, out, session), tuning.chosen
        name = tuning.next_to_try(self.explore)
        assert name is not None
        reduction = build(name).reduce(sparse, group, request, out, session)
        # the whole call is timed, agreement and encoding included, on the slowest rank
        tuning.record(name, slowest_seconds_since(start, group), self.explore)
        return reduction, tuning.chosen or tuning.next_to_try(self.explore) or name


def slowest_seconds_since(start: float, group: Group) -> float:
    """Seconds since ``start`` on the slowest rank (one small all_reduce: exploring calls only)."""
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=wire_device(group))
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def exploring_calls(transport: Transport) -> int:
    """How many calls per size class ``transport`` may spend exploring (0 if it never does)."""
    if isinstance(transport, AutoTransport):
        return transport.explore * (MAX_SHORTLIST + 2 * (TIE_BREAK_TRIALS - 1))
    return 0
