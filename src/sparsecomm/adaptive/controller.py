"""`AdaptiveController`: the ``adaptive`` pipeline's loop inside a reducer — at a step's first call
it reads the agreed reports that are due and plans the step (`Planner`); the reducer's paths fill
the step's `StepMeasurement`; when the step ends, this rank's report goes on its way to every rank
(`ReportExchange`). A forward pre-hook on the model starts each step's compute clock."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.adaptive.config import AdaptiveConfig, Plan
from sparsecomm.adaptive.link_probe import link_throughput, probe_numel
from sparsecomm.adaptive.measurement import StepMeasurement
from sparsecomm.adaptive.planner import Planner
from sparsecomm.adaptive.report_exchange import ReportExchange
from sparsecomm.sparsify.adaptive import Adaptive
from sparsecomm.transport.collectives import on_wire


class AdaptiveController:
    """The planner, its reports and its clock for one reducer (which owns and checkpoints it)."""

    def __init__(self, sparsifier: Adaptive, world_size: int, feedback_horizon: float,
                 group: dist.ProcessGroup | None, wire_device: torch.device, module: nn.Module | None,
                 config: AdaptiveConfig | None = None, received_per_sent: float | None = None) -> None:
        self.config = config or AdaptiveConfig()
        self.planner = Planner(sparsifier, world_size, feedback_horizon, self.config, received_per_sent)
        self.reports = ReportExchange(group, wire_device)
        self.plan: Plan | None = None
        """this step's plan while a step is open, else None"""
        self._forward_start: float | None = None
        """when the model's first forward pass since the last step began"""
        self._hook = module.register_forward_pre_hook(self._forward_started) if module is not None else None
        if module is not None:  # its size, before the first step measures it
            self.planner.costs.total_numel = sum(p.numel() for p in module.parameters() if p.requires_grad)

    @classmethod
    def of(cls, spec: Any, world_size: int, group: dist.ProcessGroup | None, wire_device: torch.device,
           module: nn.Module | None) -> AdaptiveController | None:
        """The controller of a reducer with pipeline ``spec`` (None unless its sparsifier is ``adaptive``),
        pricing a sparse step by what its transport brings back per byte sent, with its sparse
        path's per-byte cost and the link timed before the first step where it measures them (more
        than one rank, no user-set budget), so that step can be planned. Every rank calls it."""
        sparsifier = spec.sparsifier
        if not isinstance(sparsifier, Adaptive):
            return None
        controller = cls(sparsifier, world_size, spec.feedback.delay_horizon(), group, wire_device, module,
                         received_per_sent=spec.transport.received_per_sent(world_size))
        controller.planner.suit(spec)
        if world_size > 1 and not sparsifier.budget:
            controller.planner.calibrate(spec)
            model_numel = sum(p.numel() for p in module.parameters()) if module is not None else None
            controller.planner.costs.observe_link(*link_throughput(group, probe_numel(model_numel), wire_device,
                                                                   (torch.float32, torch.float16)))
        return controller

    @property
    def measuring(self) -> StepMeasurement:
        return self.planner.measuring

    def plan_call(self, now: float, device: torch.device) -> Plan:
        """The open step's plan for a call whose gradient is on ``device``; a step's first call
        learns the reports due (the very first at once, so that the second step already has
        numbers) and plans it."""
        if self.plan is None:
            planner = self.planner
            for step, agreed in self.reports.ready(planner.step, first=planner.reports_read == 0):
                planner.observe(agreed, step)
            self.plan = planner.begin_step(now, self._forward_start)
            self._forward_start = None
        self.planner.measuring.host_memory |= device.type == "cpu"
        return self.plan

    def report_needed(self, steps: int) -> bool:
        """Whether the report of the reducer's step ``steps`` must be heard even at the cost of an
        all_reduce of its own: every step at first, then every few — and every step whose mode
        differs from the step before's or that belongs to a trial, or a trial's samples would be
        lost. Also when this step measures the largest magnitude sent."""
        config, planner = self.config, self.planner
        return (steps < config.every_step_reports or steps % config.report_every == 0
                or planner.switched or planner.trials.trial is not None)

    def end_step(self, steps: int) -> None:
        """The open step ended (the reducer's step ``steps``): its report on its way."""
        assert self.plan is not None, "no step is open"
        planner = self.planner
        step = planner.step
        report = planner.end_step()
        self.reports.end_step(step, report, self.report_needed(steps), first=planner.reports_read == 0)
        self.reports.prefetch(planner.step, first=planner.reports_read == 0)
        self.plan = None

    def plan_with(self, node_group: dist.ProcessGroup) -> None:
        """Plan as one with ``node_group``'s ranks, whose reducers share this one's link (a node's
        ranks, each reducing its shard between nodes): agree the link probed at start-up (the
        slowest rank's) now, and every step's reports from now on (`ReportExchange.prefetch`).
        Every rank of ``node_group`` calls it, before the first step."""
        costs = self.planner.costs
        probed = [-costs.throughput[-1] if costs.throughput else 0.0,
                  -costs.fp16_throughput[-1] if costs.fp16_throughput else 0.0]
        wire = on_wire(torch.tensor(probed, dtype=torch.float64), self.reports.wire_device)
        dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=node_group)
        slowest = [-value for value in wire.cpu().tolist()]
        if costs.throughput and slowest[0] > 0:
            costs.throughput[-1] = slowest[0]
        if costs.fp16_throughput and slowest[1] > 0:
            costs.fp16_throughput[-1] = slowest[1]
        self.reports.node_group = node_group
        self.planner.sharded = True

    def _forward_started(self, module: nn.Module, inputs: Any) -> None:
        """The model's forward pre-hook: the first forward pass since the last step starts the clock."""
        if self._forward_start is None and self.plan is None:
            self._forward_start = time.perf_counter()

    def close(self) -> None:
        """Unhook the model and wait for the reports sent alone."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.reports.close()

    def state_dict(self) -> dict[str, Any]:
        return {"planner": self.planner.state_dict(), "reports": self.reports.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.planner.load_state_dict(state["planner"])
        self.reports.load_state_dict(state["reports"])
