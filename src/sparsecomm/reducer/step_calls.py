"""`StepCalls`: where the open step's calls go and how the step waits for them.

Collectives run on the reducer's own process group: asynchronous calls on the `TransportSession`'s
worker thread, in submission order, so they never interleave with the caller's collectives; a
step's last call on the caller's thread once the calls before it are done (nothing is left to
overlap it with). Payload calls expected to send few entries, and sparse gradients' rows, wait for
the step's last call and travel with it in one exchange (`AllgatherTransport.reduce_fused`): each
would cost mostly an exchange's fixed cost. The collectives a path posts itself (a dense step's
all_reduce, the device route's all_gather, a low-rank step's) are finished when the step is
(`finish`), on the thread that waits for it: not in a callback on gloo's threads, where Python
would hold the interpreter while later buckets' collectives are still in flight, nor inline where
NCCL's future is complete as soon as its work is queued, where the call's read of the device would
make the host wait for each bucket's collective before the backward pass goes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.allgather import AllgatherTransport, FusedCall
from sparsecomm.transport.base import Transport
from sparsecomm.transport.request import Reduction, Request
from sparsecomm.transport.session import TransportSession
from sparsecomm.transport.waiting import wait_polling

Finish = Callable[[torch.futures.Future], None]


class StepCalls:
    """The open step's calls in flight, waiting to be fused, or waiting to be finished."""

    def __init__(self, group: dist.ProcessGroup | None, session: TransportSession) -> None:
        self.group, self.session = group, session
        self.in_flight: list[torch.futures.Future] = []
        """the results the step waits for, and whose first error it raises"""
        self.aside: list[torch.futures.Future] = []
        """the results of calls outside the step's (`reduce_async`): the step waits for them too, and
        their errors reach their own futures alone"""
        self._deferred: list[tuple[FusedCall, torch.futures.Future]] = []
        """small calls waiting to travel with the step's last"""
        self._unfinished: list[tuple[torch.futures.Future, Finish]] = []
        """the collectives paths posted themselves (each future, and what completes its call), finished
        with the step"""

    def post(self, transport: Transport, contribution: SparseGradient | torch.Tensor, request: Request,
             out: torch.Tensor | None, last: bool, fuses: bool, waits: bool) -> torch.futures.Future[Reduction]:
        """A transport call: on this thread after the worker's calls (``last``; with those that
        waited when it ``fuses``), waiting for the step's last call (``waits``), or on the worker."""
        this_call = FusedCall(contribution, request, out)
        if last:  # collectives stay in order: the worker thread's calls first
            self.session.drain()
            if fuses:
                return self._exchange_deferred(this_call)
            self._exchange_deferred()
            future: torch.futures.Future = torch.futures.Future()
            try:
                future.set_result(transport.reduce(contribution, self.group, request, out, self.session))
            except BaseException as err:  # noqa: BLE001 - handed to the waiter, as an asynchronous call's
                future.set_exception(err)
            return future
        if waits:
            future = torch.futures.Future()
            self._deferred.append((this_call, future))
            return future
        return transport.reduce_async(contribution, self.group, request, out, self.session)

    def in_order(self) -> None:
        """Before a collective this thread posts on the reducer's group itself (a dense or low-rank
        step's all_reduce, the device route's all_gather, an agreement of its own): the worker
        thread's collectives go first, so every rank posts them all in one order (gloo matches
        collectives by order)."""
        self.session.drain()

    def track(self, result: torch.futures.Future, in_step: bool) -> None:
        """A call's result, which the step waits for (``in_step``: and raises its error)."""
        if in_step:
            self.in_flight.append(result)
        else:
            self.aside = [*(future for future in self.aside if not future.done()), result]

    def forget(self, result: torch.futures.Future) -> None:
        """A call's result its caller waits for at once (`GradientReducer.reduce`): not the step's."""
        if result in self.aside:
            self.aside.remove(result)

    def finish_with_step(self, done: torch.futures.Future, finish: Finish) -> None:
        """Run ``finish(done)`` when the step finishes, on the thread that finishes it."""
        self._unfinished.append((done, finish))

    def finish(self) -> list[BaseException]:
        """Wait for every call of the step: the calls still waiting to be fused go now, the collectives
        paths posted themselves are finished in the order they were posted. Returns the errors the
        calls met."""
        if self._deferred:  # no last call took them (a dense step's last bucket, a resumed run's reordered one)
            self.session.drain()
            self._exchange_deferred()
        unfinished, self._unfinished = self._unfinished, []
        for done, finish in unfinished:
            with contextlib.suppress(Exception):  # a failed collective: finish hands its error to the result
                wait_polling(done)
            finish(done)
        in_flight, self.in_flight = self.in_flight, []
        errors = []
        for future in in_flight:
            try:
                future.wait()
            except BaseException as err:  # noqa: BLE001 - raised by the caller, after every call ended
                errors.append(err)
        aside, self.aside = self.aside, []
        for future in aside:
            with contextlib.suppress(Exception):  # its waiter hears of it
                future.wait()
        return errors

    def abandon(self, why: str) -> None:
        """The reducer closes with a step open: every call of it not yet done ends with
        `SparseCommError` (``why``) rather than leaving its waiter waiting; the calls waiting to be
        fused never leave this rank."""
        error = SparseCommError(why)
        waiting = [future for _, future in self._deferred] + self.in_flight + self.aside
        self._deferred, self._unfinished, self.in_flight, self.aside = [], [], [], []
        for future in waiting:
            if not future.done():
                future.set_exception(error)

    def _exchange_deferred(self, last: FusedCall | None = None) -> torch.futures.Future:
        """On this thread (the worker thread drained): the deferred calls, and ``last``, in one
        exchange, each call's future set; ``last``'s future (without ``last``, an unused one)."""
        deferred, self._deferred = self._deferred, []
        last_future: torch.futures.Future = torch.futures.Future()
        if last is not None:
            deferred.append((last, last_future))
        if deferred:
            try:
                reductions = AllgatherTransport().reduce_fused([call for call, _ in deferred], self.group,
                                                               self.session)
            except BaseException as err:  # noqa: BLE001 - handed to every waiter
                for _, future in deferred:
                    future.set_exception(err)
            else:
                for (_, future), reduction in zip(deferred, reductions, strict=True):
                    future.set_result(reduction)
        return last_future
