"""`Costs`: what the agreed reports say a step costs in each mode, and the density worth sending.

- the compute time C (forward and backward) and the link's throughput β: medians of the latest;
- a dense mode's step: the `typical` whole time of its latest steps — its collectives' own work
  may slow the compute it overlaps (gloo sums fp16 on the processor that runs the backward) — and
  until fp32 has run, C plus its wire time at β; fp16 until timed: fp32's step with fp16's wire at
  the throughput of the fp16 all_reduce probed at start-up;
- a sparse step: C + O_s + κ·bytes(d), O_s the sparse path's fixed overhead (passes over the
  gradient, the codecs' per-call costs, agreement, handoffs), κ = κ_e + R(κ_d + 1/β) seconds per
  payload byte (a rank encodes its payload, then receives and decodes R bytes for each it sent:
  the transport's `Transport.received_per_sent`, P−1 for an allgather; κ_e and κ_d calibrated at
  start-up), bytes(d) = fixed bytes + d·N·(bytes per budgeted entry); on the device route
  (`Mode.DEVICE`) O_s, the bytes per entry and the fixed bytes are its own, and κ = R/β: its
  work is fixed-size tensor ops whatever the density, so its overhead holds it;
- a low-rank step (`Mode.LOW_RANK`): the `typical` whole time of its latest steps, and until one
  has been timed the compute alone, so that a trial times it where the link is slow enough to
  make it a contender;
- the density d: the median of the last densities the ranks preferred, each the d whose entries
  carry the most of the gradient's energy per second of step, E(min(1, H·d)) / (C + O_s + κ·bytes(d))
  (`energy_density`; H the horizon within which error feedback delivers what a step leaves out);
  before any preference is known, what the link and codecs carry while the step computes,
  B = C / κ bytes less the fixed bytes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from sparsecomm.adaptive.config import FP16_MAX, AdaptiveConfig, Mode, Plan
from sparsecomm.adaptive.gradient_energy import energy_share
from sparsecomm.adaptive.measurement import typical
from sparsecomm.adaptive.report import Report
from sparsecomm.sparsify.adaptive import Adaptive

WINDOWS = ("compute_s", "throughput", "fp16_throughput", "fp32_step_s", "fp16_step_s", "sparse_overhead_s",
           "preferred_density", "device_overhead_s", "low_rank_step_s")
SCALARS = ("total_numel", "budget_numel", "bytes_per_nnz", "fixed_bytes", "encode_per_byte", "decode_per_byte",
           "max_magnitude", "device_bytes_per_nnz", "device_fixed_bytes", "host_memory")


@dataclass
class Costs:
    """The agreed numbers one `Planner` plans from (it owns and checkpoints them)."""

    config: AdaptiveConfig
    sparsifier: Adaptive
    world_size: int
    feedback_horizon: float = 1.0
    """the pipeline's `Feedback.delay_horizon`: the horizon H unless the sparsifier sets one"""
    received_per_sent: float | None = None
    """R: bytes a rank receives and decodes per byte it sends on a sparse step (the transport's
    `Transport.received_per_sent`; None: an allgather's P − 1)"""
    total_numel: int = 0
    """elements reduced per step (all tensors; before the first step, the model's where known)"""
    budget_numel: int = 0
    """elements under the density per step"""
    compute_s: deque[float] = field(default_factory=deque)
    throughput: deque[float] = field(default_factory=deque)
    """β: wire bytes per second of the start-up probe's fp32 all_reduce and of the steps' dense ones"""
    fp16_throughput: deque[float] = field(default_factory=deque)
    """the same of an fp16 all_reduce, probed at start-up: fp16's wire until its steps are timed"""
    fp32_step_s: deque[float] = field(default_factory=deque)
    fp16_step_s: deque[float] = field(default_factory=deque)
    low_rank_step_s: deque[float] = field(default_factory=deque)
    """a low-rank step's whole time"""
    sparse_overhead_s: deque[float] = field(default_factory=deque)
    """O_s: what a sparse step cost beyond the compute, its payloads' wire time and per-byte cost"""
    device_overhead_s: deque[float] = field(default_factory=deque)
    """the same of a ``device`` step"""
    preferred_density: deque[float] = field(default_factory=deque)
    """the densities the steps' gradients preferred (of each step, the ranks' largest)"""
    bytes_per_nnz: float = 3.0
    """payload bytes per entry the density budgets (the planner starts it at its config's
    `AdaptiveConfig.first_bytes_per_nnz`)"""
    fixed_bytes: float = 0.0
    device_bytes_per_nnz: float = 3.0
    device_fixed_bytes: float = 0.0
    """the same two of a ``device`` step (the planner starts the first at
    `AdaptiveConfig.first_bytes_per_nnz`)"""
    encode_per_byte: float = 0.0
    decode_per_byte: float = 0.0
    """κ_e, κ_d: the slowest rank's calibrated marginal seconds per payload byte"""
    max_magnitude: float = math.inf
    """the largest |value| any rank sent lately (unknown: fp16 not allowed)"""
    host_memory: float = 1.0
    """1 where some rank's gradients are in host memory (the latest report's; until one is heard, 1)"""
    least: float = 0.0
    """this step's least density: the sparsifier's floor, or above it during its warm-up (the
    planner sets it every step; 0 until then: the floor)"""

    def __post_init__(self) -> None:
        for name in WINDOWS:
            setattr(self, name, deque(getattr(self, name), maxlen=self._window(name)))

    def _window(self, name: str) -> int:
        config = self.config
        if name in ("compute_s", "preferred_density"):
            return config.compute_window
        return config.throughput_window if name.endswith("throughput") else config.cost_window

    # -- what comes in ----------------------------------------------------------------------------
    def observe_link(self, throughput: float, fp16_throughput: float | None = None) -> None:
        """The link's throughput in fp32 (and fp16), probed at start-up (the same on every rank)."""
        self.throughput.append(throughput)
        if fp16_throughput is not None:
            self.fp16_throughput.append(fp16_throughput)

    def observe(self, agreed: Report) -> None:
        """Every rank's report of one step, agreed (each field's largest: a step takes as long as
        its slowest rank)."""
        if agreed.compute_s > 0:
            self.compute_s.append(agreed.compute_s)
        if agreed.throughput > 0:
            self.throughput.append(agreed.throughput)
        for window, whole in ((self.fp32_step_s, agreed.fp32_step_s), (self.fp16_step_s, agreed.fp16_step_s),
                              (self.low_rank_step_s, agreed.low_rank_step_s)):
            if whole > 0:
                window.append(whole)
        device = agreed.device_route > 0
        if agreed.sparse_step_s > 0:  # O_s: the slowest rank's sparse step beyond the slowest compute
            self.overhead_s(Mode.DEVICE if device else Mode.SPARSE).append(
                max(1e-6, agreed.sparse_step_s - agreed.compute_s))
        if agreed.bytes_per_nnz > 0 and device:
            self.device_bytes_per_nnz, self.device_fixed_bytes = agreed.bytes_per_nnz, agreed.fixed_bytes
        elif agreed.bytes_per_nnz > 0:
            self.bytes_per_nnz, self.fixed_bytes = agreed.bytes_per_nnz, agreed.fixed_bytes
        self.host_memory = agreed.host_memory
        if agreed.max_magnitude > 0:
            self.max_magnitude = agreed.max_magnitude
        if agreed.encode_per_byte > 0 or agreed.decode_per_byte > 0:
            self.encode_per_byte, self.decode_per_byte = agreed.encode_per_byte, agreed.decode_per_byte
        if agreed.preferred_density > 0:
            self.preferred_density.append(agreed.preferred_density)

    # -- what a step costs ------------------------------------------------------------------------
    def fp16_allowed(self) -> bool:
        """Whether the largest magnitude sent leaves fp16 its headroom."""
        return self.max_magnitude * self.config.fp16_headroom < FP16_MAX

    def dense_bytes(self) -> float:
        """An fp32 all_reduce of the whole gradient, in allgather bytes per rank."""
        return 2 / self.world_size * 4 * self.total_numel

    def step_budget(self) -> float | None:
        """Bytes the link and the codecs carry while the step computes (None: not measured yet), or
        the user-set budget."""
        if self.sparsifier.budget:
            return float(self.sparsifier.budget)
        if not self.compute_s or not self.throughput:
            return None
        return statistics.median(self.compute_s) / self.per_byte_s(statistics.median(self.throughput))

    def overhead_s(self, mode: Mode) -> deque[float]:
        """O_s of a sparse ``mode``'s steps."""
        return self.device_overhead_s if mode is Mode.DEVICE else self.sparse_overhead_s

    def per_byte_s(self, throughput: float, mode: Mode = Mode.SPARSE) -> float:
        """Seconds a sparse step in ``mode`` spends per byte a rank sends: encoding it, and
        receiving and decoding the R bytes the transport brings back for it (on the device route,
        receiving them only)."""
        received = self.received_per_sent if self.received_per_sent is not None else max(1, self.world_size - 1)
        if mode is Mode.DEVICE:
            return received / throughput
        return self.encode_per_byte + received * (self.decode_per_byte + 1 / throughput)

    def payload_bytes(self, mode: Mode) -> tuple[float, float]:
        """A sparse ``mode``'s (bytes per budgeted entry, fixed bytes)."""
        if mode is Mode.DEVICE:
            return self.device_bytes_per_nnz, self.device_fixed_bytes
        return self.bytes_per_nnz, self.fixed_bytes

    def step_bytes(self, density: Any, mode: Mode = Mode.SPARSE) -> Any:
        """Bytes one rank sends on a sparse step in ``mode`` at ``density`` (one, or a tensor of
        candidates)."""
        per_nnz, fixed = self.payload_bytes(mode)
        return fixed + density * self.budget_numel * per_nnz

    def sparse_at(self, budget: float) -> Plan:
        """A sparse step that sends ``budget`` bytes (at least this step's `least` density)."""
        density = (budget - self.fixed_bytes) / (self.bytes_per_nnz * self.budget_numel)
        return self.sparse(min(density, self.config.max_sparse_density))

    def sparse(self, density: float, mode: Mode = Mode.SPARSE) -> Plan:
        """A sparse step in ``mode`` at ``density``, raised to this step's `least` (and the
        sparsifier's floor)."""
        return Plan(mode, self.sparsifier.at_density(max(density, self.least)).density)

    def predicted(self, budget: float, device: bool = False, low_rank: bool = False) -> dict[Mode, tuple[float, Plan]]:
        """Each allowed mode's predicted whole step time times one plus its margin, and the plan
        that runs it; with ``device``, a sparse step on the device route too, at the same density
        (predicted as dear as on the codecs until a trial has timed it, so it is never chosen
        unmeasured); with ``low_rank``, a low-rank step in the sparse steps' place."""
        config = self.config
        on_link = self.dense_bytes() * (self.world_size - 1)  # a ring all_reduce's 2(P-1)/P of it, as measured
        throughput, compute = statistics.median(self.throughput), statistics.median(self.compute_s)
        fp32_cost = typical(self.fp32_step_s) if self.fp32_step_s else compute + on_link / throughput
        costs = {Mode.FP32: (fp32_cost, Plan(Mode.FP32))}
        if self.fp16_allowed():
            fp16_throughput = statistics.median(self.fp16_throughput) if self.fp16_throughput else throughput
            fp16_cost = (typical(self.fp16_step_s) if self.fp16_step_s
                         else fp32_cost - on_link / throughput + on_link / 2 / fp16_throughput)
            costs[Mode.FP16] = (fp16_cost * (1 + config.fp16_margin), Plan(Mode.FP16))
        if low_rank:
            low_rank_cost = typical(self.low_rank_step_s) if self.low_rank_step_s else compute
            costs[Mode.LOW_RANK] = (low_rank_cost * (1 + config.sparse_margin) + 1e-9, Plan(Mode.LOW_RANK))
            return costs
        if not self.sparse_overhead_s:  # exploring
            density = self.sparse(config.explore_density).density
        elif self.preferred_density:
            density = self.sparse(statistics.median(self.preferred_density)).density
        else:
            density = self.sparse_at(budget).density
        for mode in (Mode.SPARSE, Mode.DEVICE) if device else (Mode.SPARSE,):
            carrying = self.per_byte_s(throughput, mode) * self.step_bytes(density, mode)
            overhead = typical(self.overhead_s(mode)) if self.overhead_s(mode) else 0.0
            costs[mode] = ((compute + carrying + overhead) * (1 + config.sparse_margin) + 1e-9, Plan(mode, density))
        if device and not self.device_overhead_s:  # unmeasured: as dear as the codecs, until a trial times it
            costs[Mode.DEVICE] = (costs[Mode.SPARSE][0], costs[Mode.DEVICE][1])
        return costs

    def energy_density(self, samples: list[torch.Tensor], mode: Mode = Mode.SPARSE) -> float:
        """The density at which the sampled gradient (``samples``, squared entries) sends the most
        of its energy per second of a step in ``mode`` (`energy_choice`), read (0: not measurable
        yet)."""
        choice = self.energy_choice(samples, mode)
        return 0.0 if choice is None else float(choice)

    def energy_choice(self, samples: list[torch.Tensor], mode: Mode = Mode.SPARSE) -> torch.Tensor | None:
        """That density as a 0-d float64 tensor on the samples' device, unread (0: the gradient has
        no energy; None: no samples, or no costs measured yet): the argmax over the candidate
        densities d of E(min(1, H·d)) / (compute + O_s + per-byte cost · bytes(d)) of a step in
        sparse ``mode``, from the agreed costs (so every rank weighs alike) and this rank's own
        gradient. With error feedback an entry left out is sent some steps later, and one sent
        within H steps moves the weights about as it would have on time, so a step's k entries
        carry about what the H·k largest of one step's gradient hold."""
        if not samples or not self.compute_s or not self.throughput or self.budget_numel == 0:
            return None
        squares = torch.cat(samples)
        low = self.sparsifier.least
        densities = torch.logspace(math.log10(low), math.log10(max(low, self.config.max_sparse_density)),
                                   self.config.density_candidates, dtype=torch.float64, device=squares.device)
        horizon = self.sparsifier.horizon or self.feedback_horizon
        energy = energy_share(squares, (densities * horizon).clamp(max=1.0))
        overhead = typical(self.overhead_s(mode)) if self.overhead_s(mode) else 0.0
        seconds = (statistics.median(self.compute_s) + overhead
                   + self.per_byte_s(statistics.median(self.throughput), mode) * self.step_bytes(densities, mode))
        # a 0-d index would be read on the host: the best density taken by a 1-d one
        best = densities.index_select(0, (energy / seconds).argmax().view(1)).squeeze(0)
        return torch.where(energy[-1] > 0, best, 0.0)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**{name: list(getattr(self, name)) for name in WINDOWS},
                **{name: getattr(self, name) for name in SCALARS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in WINDOWS:
            setattr(self, name, deque(state[name], maxlen=self._window(name)))
        for name in SCALARS:
            setattr(self, name, state[name])
