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

With a ``node_group`` (the ranks of a node, each reducing its own shard between nodes over one
shared link), the reports due are agreed once more over the node, so that its ranks plan as one:
at a step's end the owner calls `prefetch`, whose all_reduce (MAX) is read when the next step
begins. It runs on a group of its own, started where every rank of the node is (the step's end),
so it never waits on a collective a rank of the node has yet to start.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.adaptive.report import Report, report_width
from sparsecomm.transport.collectives import on_wire
from sparsecomm.transport.waiting import wait_for

NODE_ROWS = 4
"""the steps a node agrees at once: the step before the next, and up to three older ones"""


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
        self.node_group: dist.ProcessGroup | None = None
        """the ranks the reports due are agreed with once more (None: the group's alone)"""
        self._in_node: tuple[dist.Work | None, torch.Tensor] | None = None
        """the reports due at the next step's start, on their way through the node (None: arrived)"""
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
        those of two steps back or earlier, or (``first``) whichever came first — with a node
        group, as `prefetch` agreed them over the node (none before the first step's end)."""
        if self.node_group is None:
            return self._due(step, first)
        if self._in_node is None:
            return []
        (work, rows), self._in_node = self._in_node, None
        if work is not None:
            wait_for(work, self.wire_device)
        return [(int(row[0]) - 1, Report.from_numbers(row[1:])) for row in rows.cpu().flip(0) if row[0] > 0]

    def prefetch(self, step: int, first: bool) -> None:
        """With a node group, at a step's end on every rank of the node: start agreeing the reports
        due as step ``step`` begins (`ready`, oldest first as without a node), each step's over the
        node by MAX. Row k holds the report of step ``step`` − 1 − k (an older one shares the last row)."""
        if self.node_group is None:
            return
        rows = torch.zeros(NODE_ROWS, 1 + report_width(), dtype=torch.float64)
        for sent_step, report in self._due(step, first):
            row = rows[min(NODE_ROWS - 1, max(0, step - 1 - sent_step))]
            row[0] = max(float(row[0]), sent_step + 1)  # 0: no report
            row[1:] = torch.maximum(row[1:], torch.tensor(report.numbers(), dtype=torch.float64))
        wire = on_wire(rows, self.wire_device)
        self._in_node = dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=self.node_group, async_op=True), wire

    def _due(self, step: int, first: bool) -> list[tuple[int, Report]]:
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
        """Wait for the reports sent alone, and those on their way through the node."""
        for _, work, _ in self.alone:
            work.wait()
        if self._in_node is not None and self._in_node[0] is not None:
            self._in_node[0].wait()

    def state_dict(self) -> dict[str, Any]:
        """Between steps: the held report (if no call took it) and every agreed report, each waited
        for (with a node group: those agreed over the node for the next step, which `load_state_dict`
        hands to it again)."""
        self._collect_alone()
        held = self.held
        state = {"held": None if held is None else {"step": held.step, "report": held.report.to_dict(),
                                                    "needed": held.needed},
                 "agreed": [{"step": step, "report": report.to_dict()} for step, report in self.agreed]}
        if self._in_node is not None:
            work, wire = self._in_node
            if work is not None:
                wait_for(work, self.wire_device)
            self._in_node = None, wire
            state["in_node"] = wire.cpu().tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        held = state["held"]
        self.held = None if held is None else HeldReport(held["step"], Report.from_dict(held["report"]),
                                                         held["needed"])
        self.agreed = deque((item["step"], Report.from_dict(item["report"])) for item in state["agreed"])
        self.alone.clear()
        self._in_node = None
        if state.get("in_node") is not None:  # already agreed over the node: no rank waits for another
            rows = on_wire(torch.tensor(state["in_node"], dtype=torch.float64), self.wire_device)
            self._in_node = None, rows
