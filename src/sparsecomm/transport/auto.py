"""``auto``: the exact transport that is fastest for this call's size — dense all_reduce, payload
allgather, or one of SparCML's sparse allreduce algorithms.

The α-β cost model (`sparsecomm.transport.cost_model`) ranks them from N, the largest nnz on any
rank, P and the measured codec speed, and shortlists those predicted within ``shortlist`` × the
best (at most three). With ``explore`` > 0, the first calls of each size class (N, nnz to half an
octave, P) run each shortlisted transport ``explore`` times, timing the slowest rank, and every
later call uses the one with the lowest median time (a spike in a few trials does not move it, and
it is the steady-state figure a training loop sees); the two best, when their medians are within
15%, run on to five times as many trials first, and within 5% the model's ranking stands. The
model narrows the field, measurement decides. With ``explore=0`` the model's first choice is used
directly. All ranks decide from agreed numbers (maxima over ranks) and a cost model checked to be
the same, so they always choose alike.

auto's agreement step stands in for the chosen transport's. When the call is expected to run
``allgather``, the payload is encoded before it and the step carries the payload sizes too, so
auto costs no collective more than the transport it picks.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.encode.value.floats import Float32Values
from sparsecomm.errors import SparseCommError
from sparsecomm.registry import TRANSPORTS
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.allgather import AllgatherTransport, payload_of
from sparsecomm.transport.base import ReduceContext, Transport, as_sparse
from sparsecomm.transport.collectives import Group, agreement, fingerprint, world
from sparsecomm.transport.cost_model import CostModel, load_cost_model
from sparsecomm.transport.dense import DenseTransport
from sparsecomm.transport.sparse_allreduce import SparseAllreduce

VALUE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}
MAX_SHORTLIST = 3


def estimated_payload_bytes_per_nnz(context: ReduceContext, numel: int, nnz: int) -> float:
    """A cheap size estimate for the pipeline's codecs (gap codes: about log2(N/k) + 1.5 bits)."""
    index_name = (context.index_codec or RiceIndices()).name
    value_name = (context.value_codec or Float32Values()).name
    gap_bytes = (math.log2(max(1.0, numel / max(nnz, 1))) + 1.5) / 8
    index_bytes = {"raw": 4.0, "bitmap": numel / 8 / max(nnz, 1)}.get(index_name, gap_bytes)
    return index_bytes + VALUE_BYTES.get(value_name, 4.0)


def predicted_costs(model: CostModel, workers: int, numel: int, nnz: int, isize: int,
                    payload_bytes_per_nnz: float) -> dict[str, float]:
    """Predicted seconds of every exact transport, keyed by its spec."""
    costs = {"dense": model.dense(workers, numel, isize),
             "allgather": model.allgather(workers, numel, nnz, payload_bytes_per_nnz)}
    for algorithm, cost in model.sparse_algorithms(workers, numel, nnz, isize).items():
        costs[f"sparse_allreduce(algorithm={algorithm})"] = cost
    return costs


def choose(model: CostModel, workers: int, numel: int, nnz: int, isize: int,
           payload_bytes_per_nnz: float) -> tuple[str, dict[str, float]]:
    """The model's first choice and all its predictions."""
    costs = predicted_costs(model, workers, numel, nnz, isize, payload_bytes_per_nnz)
    return min(costs, key=costs.__getitem__), costs


CLOSE = 1.15
"""a runner-up whose median is within this factor of the leader's is a near-tie: both get more trials"""
TIE_BREAK_TRIALS = 5
"""in a near-tie, the two finalists run up to this many times ``explore`` trials each"""
INDISTINGUISHABLE = 1.05
"""medians within this factor are noise apart (auto's trials run back to back, a training loop's
calls do not: that alone shifted two transports 4% against each other): the model's ranking decides"""


@dataclass
class Tuning:
    """What auto has measured for one size class (the same on every rank).

    Every candidate runs ``trials`` times, interleaved. When the two best medians are within
    `CLOSE`, a handful of noisy samples cannot order them: those two run on, interleaved, to
    `TIE_BREAK_TRIALS` × ``trials`` each. The lowest median wins, unless a candidate the model
    ranks higher (``candidates`` is in the model's order) is within `INDISTINGUISHABLE` of it."""

    candidates: list[str]
    seconds: dict[str, list[float]] = field(default_factory=dict)
    chosen: str | None = None
    finalists: list[str] | None = None

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def next_to_try(self, trials: int) -> str | None:
        pool, target = (self.candidates, trials) if self.finalists is None else (
            self.finalists, TIE_BREAK_TRIALS * trials)
        pending = [c for c in pool if len(self.seconds.get(c, [])) < target]
        return min(pending, key=lambda c: len(self.seconds.get(c, []))) if pending else None

    def record(self, name: str, seconds: float, trials: int) -> None:
        self.seconds.setdefault(name, []).append(seconds)
        if self.next_to_try(trials) is not None:
            return
        ranked = sorted(self.finalists or self.candidates, key=self.median)
        fastest = self.median(ranked[0])
        if self.finalists is None and len(ranked) > 1 and self.median(ranked[1]) <= CLOSE * fastest:
            self.finalists = ranked[:2]
        else:
            self.chosen = next(c for c in self.candidates  # the model's order
                               if c in ranked and self.median(c) <= INDISTINGUISHABLE * fastest)


_TUNINGS: dict[tuple, Tuning] = {}
_EXPECTED: dict[tuple, str] = {}
"""per stream (group, N, value size, P, auto's settings): what its next call will run if its size
class stays the same (the same on every rank: it is derived from agreed numbers only)"""


def size_class(group: Group, numel: int, nnz: int, isize: int, workers: int, settings: tuple) -> tuple:
    return (id(group), numel, round(2 * math.log2(nnz + 1)), isize, workers, settings)


def build(name: str) -> Transport:
    if name == "dense":
        return DenseTransport()
    if name == "allgather":
        return AllgatherTransport()
    return SparseAllreduce(algorithm=name.split("=")[1].rstrip(")"))


@TRANSPORTS.register("auto")
@dataclass(frozen=True)
class AutoTransport(Transport):
    explore: int = 5
    """timed trials per shortlisted transport in each size class (0: trust the model)"""
    shortlist: float = 3.0
    """keep candidates predicted within this factor of the best"""

    def __post_init__(self) -> None:
        if self.explore < 0 or self.shortlist < 1.0:
            raise SparseCommError("auto needs explore >= 0 and shortlist >= 1")

    def allreduce(self, grad: SparseGradient | torch.Tensor, group: Group = None,
                  context: ReduceContext | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        start = time.perf_counter()
        sparse = as_sparse(grad)
        context = context or ReduceContext()
        _, workers = world(group)
        model = load_cost_model()
        isize = sparse.values.element_size()
        stream = (id(group), sparse.numel, isize, workers, self.to_spec())
        expected = _EXPECTED.get(stream)  # what the stream's size class would run next
        # Sparse transports sort the indices before their agreement step; sorting after it (once
        # all ranks are in step) measured 10% slower at 1.6M nnz, so auto sorts first too
        if expected != "dense":
            sparse = sparse.sorted()
        # Likewise allgather encodes before its agreement step, which then carries the payload
        # sizes: allgather needs no size exchange of its own
        saved_payload = context.payload
        if expected == "allgather":
            context.payload = payload_of(sparse, group, context)
        max_nnz, sizes = agreement(group, sparse.numel, fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype,
                                                                    model.fingerprint()), sparse.nnz,
                                   nonfinite=context.nonfinite,
                                   nbytes=len(context.payload) if context.payload is not None else 0)
        best, costs = choose(model, workers, sparse.numel, max_nnz, isize,
                             estimated_payload_bytes_per_nnz(context, sparse.numel, max_nnz))
        context.extra.update({f"predicted {name} ms": 1e3 * cost for name, cost in costs.items()})
        context.agreed_nnz, context.agreed_sizes = max_nnz, sizes  # the chosen transport needs no agreement step
        try:
            result, _EXPECTED[stream] = self._run(sparse, group, context, out, best, costs, workers, isize, max_nnz,
                                                  start)
            return result
        finally:
            context.agreed_nnz, context.agreed_sizes, context.payload = None, None, saved_payload

    def _run(self, sparse: SparseGradient, group: Group, context: ReduceContext, out: torch.Tensor | None,
             best: str, costs: dict[str, float], workers: int, isize: int, max_nnz: int,
             start: float) -> tuple[torch.Tensor, str]:
        """The sum, and what the next call of this size class will run."""
        if self.explore == 0:
            return build(best).allreduce(sparse, group, context, out), best
        key = size_class(group, sparse.numel, max_nnz, isize, workers, (self.explore, self.shortlist))
        if key not in _TUNINGS:
            ranked = sorted(costs, key=costs.__getitem__)
            _TUNINGS[key] = Tuning([n for n in ranked if costs[n] <= self.shortlist * costs[best]][:MAX_SHORTLIST])
        tuning = _TUNINGS[key]
        if tuning.chosen is not None:
            return build(tuning.chosen).allreduce(sparse, group, context, out), tuning.chosen
        name = tuning.next_to_try(self.explore)
        assert name is not None
        result = build(name).allreduce(sparse, group, context, out)
        # the whole call is timed, agreement and encoding included, on the slowest rank
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        tuning.record(name, float(elapsed), self.explore)
        return result, tuning.chosen or tuning.next_to_try(self.explore) or name


def exploring_calls(transport: Transport) -> int:
    """How many calls per size class ``transport`` may spend exploring (0 if it never does)."""
    if isinstance(transport, AutoTransport):
        return transport.explore * (MAX_SHORTLIST + 2 * (TIE_BREAK_TRIALS - 1))
    return 0
