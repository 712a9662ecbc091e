"""What every path gets and gives: `Parts` (the reducer's shared pieces), `Pending` (a posted
call), and `Path`, whose `post` runs a call's local stages and posts its collective, and whose
`summed` reads the collective's result; `TransportPath` posts through a `Transport`."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from sparsecomm.adaptive.config import Plan
from sparsecomm.adaptive.controller import AdaptiveController
from sparsecomm.errors import NonFiniteError
from sparsecomm.pipeline import Pipeline
from sparsecomm.reducer.call import Call, Route, Summed
from sparsecomm.reducer.config import ReducerConfig
from sparsecomm.reducer.stats import ReducerStats
from sparsecomm.reducer.step_calls import StepCalls
from sparsecomm.reducer.uncompressed import UncompressedFeedback
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.allgather import AllgatherTransport
from sparsecomm.transport.base import Transport
from sparsecomm.transport.request import Reduction, Request

FUSE_BELOW = 1 << 14
"""a payload-carrying call expected to send fewer entries than this waits for its step's last call
and travels in one exchange with it: such calls cost mostly a call's fixed cost, while larger ones
gain more from starting while the backward pass runs (0: nothing waits)"""


@dataclass(frozen=True)
class Parts:
    """The reducer's pieces its paths share (the reducer owns them)."""

    config: ReducerConfig
    pipeline: Pipeline
    calls: StepCalls
    uncompressed: UncompressedFeedback
    stats: ReducerStats
    process_group: dist.ProcessGroup
    wire_device: torch.device
    rank: int
    adaptive: AdaptiveController | None = None


@dataclass
class Pending:
    """A posted call: the future of its collective, when its local stages ended, whether the step
    finishes it on its own thread, and what its path reads back."""

    future: torch.futures.Future
    submitted: float
    finish_with_step: bool = False
    carries_report: bool = False
    sent: Any = None
    """the path's own record of what it sent (`Sent`, `dense_step.Wire`)"""


@dataclass(frozen=True)
class Sent:
    """What a transport call sent: this rank's contribution, the buffer the sum lands in, and
    whether making the contribution took a step of this rank's state (not where its gradient was
    non-finite or its codec refused it; a refusal still moved its feedback)."""

    contribution: SparseGradient | torch.Tensor
    out: torch.Tensor | None
    stepped: bool = False
    sat_out: bool = False
    """this rank's gradient was non-finite, and the call left its state untouched"""


class Path(ABC):
    """One route's local stages, collective and state."""

    route: ClassVar[Route]

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    @abstractmethod
    def post(self, call: Call, plan: Plan | None, start: float) -> Pending:
        """Run the call's local stages (they began at ``start``) and post its collective."""

    @abstractmethod
    def summed(self, call: Call, pending: Pending, done: torch.futures.Future) -> Summed:
        """The collective's result (it raises what the collective met)."""

    def checked(self, call: Call, pending: Pending, summed: Summed) -> torch.Tensor:
        """The sum, once the path has checked it, in the buffer the completion works on."""
        return summed.total

    def measured(self, call: Call, pending: Pending, summed: Summed) -> None:
        """The adaptive controller's share of a finished call: bytes outside the budget by default."""
        assert self.parts.adaptive is not None
        self.parts.adaptive.measuring.finished(time.perf_counter(), summed.bytes_sent)

    @abstractmethod
    def after_average(self, call: Call, pending: Pending, total: torch.Tensor) -> torch.Tensor:
        """What the feedback owns, applied to the average."""

    def take_back(self, call: Call, lost: SparseGradient) -> None:  # noqa: B027 - most paths lose nothing
        """What the collective lost of this rank's contribution (`Summed.lost`): the feedback's to
        send again. Dropped by default."""

    def withdrawn(self, call: Call, pending: Pending) -> None:  # noqa: B027 - most paths change state on success
        """The call failed on every rank (its collective or the sum's check raised), so no rank
        applied it: undo what posting it did to this rank's state. Nothing by default."""

    def state_dict(self) -> dict[str, Any]:
        """The path's own state between steps (none by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - most paths keep no state
        """Restore `state_dict`."""


class TransportPath(Path):
    """A path whose collective is a transport call, agreement step included."""

    def post(self, call: Call, plan: Plan | None, start: float) -> Pending:
        parts = self.parts
        adaptive = parts.adaptive
        side = adaptive.reports.take() if adaptive is not None else None  # rides on the agreement step
        request = Request(key=call.key, call=call.number, seed=parts.config.seed, step=parts.stats.steps,
                          index_codec=parts.config.spec.index_codec, value_codec=parts.config.spec.value_codec,
                          side=side or ())
        transport, contribution, request = self.contribution(call, request, plan)
        sat_out = request.nonfinite and not request.refused  # its gradient non-finite: its state untouched
        if request.refused and parts.config.nonfinite == "propagate":
            # a value its codec cannot carry (beyond fp16's range, as a scaled loss's overflow makes it)
            # is non-finite on the wire: every rank's average NaN
            request = replace(request, nonfinite=True)
        submitted = time.perf_counter()
        if adaptive is not None:
            adaptive.measuring.submitted(call.tensor.numel(), *self.budget_counts(call, plan), submitted - start,
                                         submitted)
        tensor = call.tensor
        # the sum lands in the gradient, where it can be written in place
        out = tensor if not tensor.is_sparse and tensor.is_contiguous() and not tensor.requires_grad else None
        fuses = call.in_step and isinstance(transport, AllgatherTransport) and FUSE_BELOW > 0
        expected = self.expected_entries(call, plan) if fuses else 0
        waits = fuses and (expected is None or expected < FUSE_BELOW)
        future = parts.calls.post(transport, contribution, request, out, call.last, fuses, waits)
        stepped = not request.nonfinite and not request.refused
        return Pending(future, submitted, carries_report=side is not None,
                       sent=Sent(contribution, out, stepped, sat_out))

    @abstractmethod
    def contribution(self, call: Call, request: Request,
                     plan: Plan | None) -> tuple[Transport, SparseGradient | torch.Tensor, Request]:
        """(the transport, this rank's contribution, the request) for one call."""

    def budget_counts(self, call: Call, plan: Plan | None) -> tuple[int, int, int]:
        """(entries under the density, entries it plans to send, nonzeros sent whole besides)."""
        return 0, 0, 0

    def expected_entries(self, call: Call, plan: Plan | None) -> int | None:
        """How many entries the call is expected to send, from what every rank knows alike, so every
        rank defers the same calls (None: it always waits for the step's last call)."""
        return call.tensor.numel()

    def summed(self, call: Call, pending: Pending, done: torch.futures.Future) -> Summed:
        reduction: Reduction = done.wait()
        out = pending.sent.out
        agreement = reduction.record.agreement
        return Summed(reduction.total, reduction.record.bytes_sent, reduction.record.decode_s,
                      owned=out is not None and reduction.total is out, carried_report=pending.carries_report,
                      sides=agreement.sides if agreement is not None else None, lost=reduction.lost)


def non_finite_sum(key: str) -> NonFiniteError:
    """The error every rank raises where a step's sum is non-finite: a rank's NaN or Inf, or an overflow."""
    return NonFiniteError(f"a rank had a non-finite gradient (NaN or Inf) in {key!r}, or the sum overflowed; "
                           "no rank applied it")


def refused(request: Request, error: Exception) -> Request:
    """The request of a rank whose codec could not carry its values: every rank raises with it."""
    return replace(request, refused=str(error))
