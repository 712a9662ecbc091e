"""`ReportExchange`: the controller's per-step reports on their way to every rank, riding on
collectives the next step runs anyway.

A step's `Report` is held until the next step's first call that can carry it: a transport call
carries it in its agreement record, a dense all_reduce in a tail of
`sparsecomm.transport.side_numbers.tail_elements` extra elements. Every rank gets back every
rank's numbers there; their largest is the agreed report (what an all_reduce with MAX would give),
which the planner observes when the step after next begins — so a step's numbers cost no
collective of their own. Which call carries is decided by call order and tensor kind alone, the
same on every rank.

Two exceptions send a report alone, in one small all_reduce (MAX):

- the very first report, read when the next step begins, so the second step already has numbers;
- a report the next step could not carry (a step of sparse COO tensors only) that the planner must
  hear (``needed``: its early steps, every few steps, a step whose mode switched), read when the
  step after next begins as a carried one would be. A report neither carried nor needed is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.adaptive.report import Report
from sparsecomm.transport.collectives import on_wire
from sparsecomm.transport.waiting import wait_for


@dataclass
class HeldReport:
    """This rank's report of ``step``, waiting for a call to carry it."""

    step: int
    report: Report
    needed: bool
    taken: bool = False
    """a call of the next step is carrying it"""


class ReportExchange:
    """Held, in-flight and agreed reports of one controller (which owns and checkpoints them)."""

    def __init__(self, group: dist.ProcessGroup | None, wire_device: torch.device) -> None:
        self.group, self.wire_device = group, wire_device
        self.held: HeldReport | None = None
        self.agreed: deque[tuple[int, Report]] = deque()
        """(step, agreed report) not yet observed, oldest first"""
        self.alone: deque[tuple[int, dist.Work, torch.Tensor]] = deque()
        """(step, all_reduce, its numbers) sent alone and not yet read"""

    def take(self, needed_only: bool = False) -> tuple[float, ...] | None:
        """The held report's numbers for the call about to run, if no earlier call of this step took
        them (and, with ``needed_only``, if the planner must hear it: for a call that pays to carry it)."""
        if self.held is None or self.held.taken or (needed_only and not self.held.needed):
            return None
        self.held.taken = True
        return self.held.report.numbers()

    def carried(self, sides: torch.Tensor | None) -> None:
        """The carrying call finished: every rank's numbers (world size × fields), or None if it
        brought none back."""
        if self.held is not None and sides is not None:
            self.agreed.append((self.held.step, Report.agreed(sides)))
            self.held = None

    def end_step(self, step: int, report: Report, needed: bool, first: bool) -> None:
        """Step ``step`` ended with this rank's ``report``: the last one, if no call carried it and
        it is ``needed``, goes alone now; the new one goes alone now if it is the ``first``, else it
        waits for a carrier."""
        held, self.held = self.held, None
        if held is not None and held.needed and not held.taken:
            self.send_alone(held.step, held.report)
        if first:
            self.send_alone(step, report)
        else:
            self.held = HeldReport(step, report, needed)

    def ready(self, step: int, first: bool) -> list[tuple[int, Report]]:
        """The agreed reports (each with its step) the planner observes as step ``step`` begins:
        those of two steps back or earlier, or (``first``) whichever came first."""
        self._collect_alone()
        due = [(sent_step, report) for sent_step, report in self.agreed if first or sent_step <= step - 2]
        self.agreed = deque(item for item in self.agreed if not (first or item[0] <= step - 2))
        return due

    def _collect_alone(self) -> None:
        """Wait for the reports sent alone and put them among the agreed ones, in step order."""
        for sent_step, work, numbers in self.alone:
            wait_for(work, self.wire_device)
            self.agreed.append((sent_step, Report.from_numbers(numbers.cpu())))
        self.alone.clear()
        self.agreed = deque(sorted(self.agreed, key=lambda item: item[0]))

    def send_alone(self, step: int, report: Report) -> None:
        """``report`` to every rank in an all_reduce (MAX) of its own."""
        wire = on_wire(torch.tensor(report.numbers(), dtype=torch.float64), self.wire_device)
        work = dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.alone.append((step, work, wire))

    def close(self) -> None:
        """Wait for the reports sent alone."""
        for _, work, _ in self.alone:
            work.wait()

    def state_dict(self) -> dict[str, Any]:
        """Between steps: the held report (if no call took it) and every agreed report, each waited for."""
        self._collect_alone()
        held = self.held
        return {"held": None if held is None else {"step": held.step, "report": held.report.to_dict(),
                                                   "needed": held.needed},
                "agreed": [{"step": step, "report": report.to_dict()} for step, report in self.agreed]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        held = state["held"]
        self.held = None if held is None else HeldReport(held["step"], Report.from_dict(held["report"]),
                                                         held["needed"])
        self.agreed = deque((item["step"], Report.from_dict(item["report"])) for item in state["agreed"])
        self.alone.clear()
