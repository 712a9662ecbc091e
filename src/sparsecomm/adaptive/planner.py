"""`Planner`: what each step of an ``adaptive`` pipeline sends — the whole gradient where the link
carries it while the step computes, otherwise its largest entries at the density that moves the
most gradient energy per second of step, or each matrix as a low-rank product — and in which
`Mode`: fp32 or fp16 (dense steps), sparse, or low rank.

Every rank measures its step (`StepMeasurement`) and reports it (`Report`); every rank plans from
the agreed reports alone (`Costs`, `Trials`), so every rank's plan is the same. The first step runs
sparse at `AdaptiveConfig.explore_density` (or low-rank) when the link was timed at start-up
(`link_probe`), fp32 otherwise (to measure it). The least density is the ``floor``, or during the
``warmup`` steps higher: it falls geometrically from `AdaptiveConfig.max_sparse_density` to the
floor, as DGC eases sparsity in. A step is fp32 on every ``probe``-th step (to measure again), and, unless its
compressed steps are low-rank ones, whenever the link carries the whole fp32 gradient within the
compute time. fp16 is allowed while the largest magnitude sent leaves `AdaptiveConfig.fp16_headroom`
of fp16's range. Where the pipeline has a device form and its sparsifier's ``device_route`` weighs
it where the gradients are (`Planner.device_weighed`), a sparse step may also go on the device route
(`Mode.DEVICE`): the trials put the two routes side by side as they do the modes. Where the pipeline
asks for low-rank steps (`Planner.low_rank_step`), they take the sparse steps' place, weighed
against fp32 and fp16 by the same trials (their time unknown, the compute alone: a slow link tries
them at once). Until sparse steps have been measured their fixed overhead counts as 0, so a link
slower than the compute gets sparse steps at the exploring density — the first warms the sparse
path up and is not counted — until their cost is known, cheaply where sparse does not pay. Where a
dense step is predicted to cost at most a few sparse ones (`AdaptiveConfig.explore_between`), a
dense step follows each of them: what one held back then goes out with the next step.

A user-set ``budget`` (bytes per step) replaces the measured one and the preferred density, and
turns the probes off: bytes alone decide the mode (fp32, fp16 or sparse, whichever the budget
holds) and a run repeats bit for bit.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from sparsecomm.adaptive.calibration import marginal_sparse_cost
from sparsecomm.adaptive.config import AdaptiveConfig, Mode, Plan
from sparsecomm.adaptive.costs import Costs
from sparsecomm.adaptive.measurement import StepMeasurement
from sparsecomm.adaptive.report import Report
from sparsecomm.adaptive.trials import Trials
from sparsecomm.device.support import device_form
from sparsecomm.feedback.residual import Residual
from sparsecomm.sparsify.adaptive import Adaptive
from sparsecomm.spec import PipelineSpec


@dataclass
class Planner:
    """The ``adaptive`` sparsifier's plan for one reducer: measurements in, a `Plan` per step out."""

    sparsifier: Adaptive
    world_size: int
    feedback_horizon: float = 1.0
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    received_per_sent: float | None = None
    """the transport's `Transport.received_per_sent` at this world size (None: an allgather's)"""
    device_form: bool = False
    """whether the pipeline's sparse steps may take the device route in its device form
    (`sparsecomm.device.support.device_form`; a pipeline that is its own device form takes it always)"""
    low_rank_form: bool = False
    """whether the pipeline's compressed steps are low-rank ones (`Mode.LOW_RANK`) in the sparse
    steps' place: its sparsifier asks for a rank and its feedback is ``residual``"""
    sharded: bool = False
    """whether the reducer's calls hold shards of buckets (between nodes, `AdaptiveController.plan_with`),
    which hold no matrices to factor: no low-rank steps"""
    step: int = 0
    codec_cost: tuple[float, float] = (0.0, 0.0)
    """this rank's own calibrated (κ_e, κ_d) (`calibrate`), carried by every report"""
    current: Plan = Plan(Mode.FP32)
    switched: bool = False
    """whether this step's mode differs from the step before's: its cost must reach a report"""
    measuring: StepMeasurement = field(default_factory=StepMeasurement)
    finished: StepMeasurement | None = None
    last_compute_s: float = 0.0
    """the finished step's compute time, known once the next step starts (without a forward hook)"""
    sparse_steps: int = 0
    """steps in either sparse mode"""
    reports_read: int = 0
    mode_steps: dict[Mode, int] = field(default_factory=dict)
    """how many steps ran in each mode"""
    costs: Costs = field(init=False)
    trials: Trials = field(init=False)

    def __post_init__(self) -> None:
        first = self.config.first_bytes_per_nnz
        self.costs = Costs(self.config, self.sparsifier, self.world_size, self.feedback_horizon,
                           self.received_per_sent, bytes_per_nnz=first, device_bytes_per_nnz=first)
        self.trials = Trials(self.config)

    def suit(self, spec: PipelineSpec) -> None:
        """The pipeline changed for its optimizer (before the first step): its sparsifier, its
        feedback's `Feedback.delay_horizon` and whether it has a device form."""
        assert isinstance(spec.sparsifier, Adaptive)
        self.sparsifier = self.costs.sparsifier = spec.sparsifier
        self.feedback_horizon = self.costs.feedback_horizon = spec.feedback.delay_horizon()
        self.device_form = device_form(spec) is not None
        self.low_rank_form = spec.sparsifier.low_rank > 0 and isinstance(spec.feedback, Residual)

    def device_weighed(self) -> bool:
        """Whether this step weighs the device route against the pipeline's codecs: it has a device
        form, no user-set budget (bytes alone decide there, and the codecs send fewer), and its
        sparsifier's ``device_route`` is ``any``, or ``accelerator`` while every rank's gradients
        are off the host (as the latest report says; the device route saves the copies to and
        from the host and the reads of the device that the codecs make)."""
        route = self.sparsifier.device_route
        return (self.device_form and not self.sparsifier.budget
                and (route == "any" or route == "accelerator" and self.costs.host_memory == 0))

    # -- the reducer's calls, in step order ------------------------------------------------------
    def calibrate(self, spec: Any) -> None:
        """Time this rank's sparse path once (`marginal_sparse_cost`); every report carries the result."""
        self.codec_cost = marginal_sparse_cost(spec, self.config.calibration_numel, self.config.calibration_nnz)

    def sample_energy(self, gradient: torch.Tensor, spans: list[tuple[int, int]]) -> None:
        """Keep the squares of every stride-th entry of the ``(start, numel)`` spans of a flat
        gradient that the budget covers, this step's sample for `Costs.energy_density` (about
        `AdaptiveConfig.energy_samples` of the model's entries; the offset turns with the step)."""
        if not self.measuring.wants_energy:
            return
        stride = max(1, (self.costs.total_numel or gradient.numel()) // self.config.energy_samples)
        offset = self.step % stride
        for start, numel in spans:
            if numel > offset:
                self.measuring.energy_samples.append(
                    gradient[start + offset:start + numel:stride].detach().to(torch.float32).square())

    def begin_step(self, now: float, forward_start: float | None = None) -> Plan:
        """The first call of a step (whose forward pass began at ``forward_start``, when known):
        time the last step's compute if no forward hook did, and plan this step."""
        if self.finished is not None and self.finished.first_submit is not None:
            self.last_compute_s = self.finished.compute_s(now)
        self.finished = None
        self.measuring = StepMeasurement(first_submit=now, forward_start=forward_start, codec_cost=self.codec_cost)
        previous, self.current = self.current.mode, self.plan()
        self.switched = self.current.mode != previous
        # a preferred density matters only to steps that select entries, and not to a user-set budget;
        # until the first is known every sparse step samples, so that the first choice between the
        # modes weighs sparse steps at the density they will run at, not at what the link carries
        self.measuring.wants_energy = (self.current.mode.selects
                                       and (self.sparse_steps % self.config.energy_every == 0
                                            or not self.costs.preferred_density)
                                       and not self.sparsifier.budget)
        self.mode_steps[self.current.mode] = self.mode_steps.get(self.current.mode, 0) + 1
        return self.current

    def end_step(self) -> Report:
        """The step ended: this rank's report (see `Report`'s fields)."""
        config, costs, done = self.config, self.costs, self.measuring
        self.finished = done
        costs.total_numel, costs.budget_numel = done.total_numel, done.budget_numel
        self.step += 1
        per_nnz = done.payload_bytes / done.payload_nnz if done.payload_nnz else 0.0
        fixed = done.fixed_bytes + done.whole_nnz * per_nnz
        selected = done.payload_nnz - done.whole_nnz
        per_budgeted = per_nnz * selected / done.planned_nnz if done.planned_nnz and selected > 0 else per_nnz
        cost = done.local_s + max(0.0, done.last_done - done.last_submit)
        compute = done.forward_backward_s() if done.forward_start is not None else self.last_compute_s
        mode = self.current.mode
        whole = dict.fromkeys(Mode, 0.0)
        if not mode.selects:  # a dense or low-rank step (the first low-rank one builds its layout: not timed)
            warm = mode.dense or self.mode_steps.get(mode, 0) >= config.exploration_steps
            if self.step > config.warmup_steps and warm:
                # the whole step: where a collective's own work competes with the backward for the
                # processor (gloo's fp16 sums on a CPU), the compute it slowed counts against it
                whole[mode] = compute + cost
        else:
            self.sparse_steps += 1
            if self.mode_steps.get(mode, 0) >= config.exploration_steps and costs.throughput:
                sent = done.payload_bytes + done.fixed_bytes
                wire = (self.world_size - 1) * sent / statistics.median(costs.throughput)
                encode_per_byte, decode_per_byte = done.codec_cost if mode is Mode.SPARSE else (0.0, 0.0)
                codecs = (encode_per_byte + (self.world_size - 1) * decode_per_byte) * done.payload_bytes
                whole[mode] = max(1e-6, compute + cost - wire - codecs)
        throughput = done.wire_bytes / done.wire_s if done.wire_s > 0 else 0.0
        preferred = (done.preferred_density if done.preferred_density is not None
                     else costs.energy_density(done.energy_samples, mode))
        return Report(compute, throughput, whole[Mode.FP32], whole[Mode.FP16], whole[Mode.SPARSE] + whole[Mode.DEVICE],
                      per_budgeted, fixed, done.max_magnitude, *done.codec_cost, preferred,
                      device_route=float(mode is Mode.DEVICE), host_memory=float(done.host_memory),
                      low_rank_step_s=whole[Mode.LOW_RANK])

    def observe(self, agreed: Report, step: int | None = None) -> None:
        """Every rank's report of one step (``step``, when known), agreed."""
        costs = self.costs
        self.reports_read += 1
        costs.observe(agreed)
        running = self.trials.running(step) if step is not None else None
        if running is not None:
            mode, density = running
            whole = {Mode.FP32: agreed.fp32_step_s, Mode.FP16: agreed.fp16_step_s,
                     Mode.LOW_RANK: agreed.low_rank_step_s}.get(mode, agreed.sparse_step_s)
            if whole > 0 and mode.selects and costs.throughput:  # its payloads' wire and codec time back in
                whole += (costs.per_byte_s(statistics.median(costs.throughput), mode)
                          * costs.step_bytes(density, mode))
            self.trials.reported(step, whole)  # type: ignore[arg-type]

    # -- the plan -------------------------------------------------------------------------------
    def plan(self) -> Plan:
        """This step's plan, from agreed numbers only (so every rank's is the same)."""
        sparsifier, costs = self.sparsifier, self.costs
        if self.world_size == 1 or (self.step < sparsifier.dense_start and not sparsifier.budget):
            return Plan(Mode.FP32)
        # a user's byte budget holds from the first step; a measured one eases sparsity in
        costs.least = sparsifier.least_at(self.step, self.config.max_sparse_density) if not sparsifier.budget else 0.0
        if self.step == 0 and costs.throughput and not sparsifier.budget:
            # the link probed at start-up, the compute not timed yet: sparse at the exploring density
            # (or low-rank), cheap on any link, and a first sparse step warms the sparse path up
            return Plan(Mode.LOW_RANK) if self.low_rank_step() else costs.sparse(self.config.explore_density)
        dense_bytes = costs.dense_bytes()
        if costs.budget_numel == 0:
            if self.step == 0 and 0 < sparsifier.budget < dense_bytes / 2:
                # a user budget below fp16's bytes (the model's size told before the first step, what
                # the budget covers not yet measured): sparse from the start, at the floor density
                return Plan(Mode.SPARSE, sparsifier.least)
            return Plan(Mode.FP32)
        if sparsifier.budget:  # user-set: bytes alone decide, no timing
            fixed = sparsifier.budget
            if fixed >= dense_bytes:
                return Plan(Mode.FP32)
            return Plan(Mode.FP16) if costs.fp16_allowed() and fixed >= dense_bytes / 2 else costs.sparse_at(fixed)
        budget = costs.step_budget()
        probing = sparsifier.probe and self.step > 0 and self.step % sparsifier.probe == 0
        if budget is None or probing:
            return Plan(Mode.FP32)
        if self.low_rank_step():
            # low-rank steps in the sparse steps' place, weighed against fp32 and fp16 by trials even
            # where the link carries fp32 while the step computes: where the collectives share the
            # processors with the backward (gloo on CPUs), a dense step still costs more than its wire
            return self.trials.choose(costs.predicted(budget, low_rank=True), self.step, self.mode_steps)
        if budget >= dense_bytes:
            return Plan(Mode.FP32)
        predicted = costs.predicted(budget, device=self.device_weighed())
        if not costs.sparse_overhead_s:  # the sparse path's cost unknown: learn it (cheap steps) before choosing
            return self.exploring(predicted)
        return self.trials.choose(predicted, self.step, self.mode_steps)

    def low_rank_step(self) -> bool:
        """Whether low-rank steps take the sparse steps' place: where the pipeline allows it
        (`low_rank_form`), the calls hold whole tensors and no user-set budget holds."""
        return self.low_rank_form and not self.sharded and not self.sparsifier.budget

    def exploring(self, predicted: dict[Mode, tuple[float, Plan]]) -> Plan:
        """A step while the sparse path's cost is unknown: sparse, unless the step before was, at the
        exploring density (`AdaptiveConfig.explore_density`; a warm-up's higher density holds
        little back), and a dense step is predicted to cost at most
        `AdaptiveConfig.explore_between` sparse ones."""
        sparse_cost, sparse = predicted[Mode.SPARSE]
        dense_cost, dense = min((predicted[mode] for mode in (Mode.FP32, Mode.FP16) if mode in predicted),
                                key=lambda choice: choice[0])
        exploring = max(self.config.explore_density, self.sparsifier.least)
        held_back = not self.current.dense and self.current.density <= exploring
        if held_back and dense_cost <= self.config.explore_between * sparse_cost:
            return dense
        return sparse

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "costs": self.costs.state_dict(), "trials": self.trials.state_dict(),
                "last_compute_s": self.last_compute_s, "sparse_steps": self.sparse_steps,
                "reports_read": self.reports_read, "mode": self.current.mode.value, "density": self.current.density,
                "mode_steps": {mode.value: count for mode, count in self.mode_steps.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.costs.load_state_dict(state["costs"])
        self.trials.load_state_dict(state["trials"])
        self.last_compute_s, self.sparse_steps = state["last_compute_s"], state["sparse_steps"]
        self.reports_read = state["reports_read"]
        # the last step's plan: whether the next one switches, and (exploring) whether it held back
        self.current = Plan(Mode(state["mode"]), state.get("density", 1.0))
        self.mode_steps = {Mode(mode): count for mode, count in state["mode_steps"].items()}
        self.finished = None
