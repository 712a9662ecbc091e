"""`StepMeasurement`: what one rank sees during one step, filled call by call by the reducer's
paths and read once when the step ends (`Planner.end_step`)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class StepMeasurement:
    """One rank's numbers of one step."""

    first_submit: float | None = None
    forward_start: float | None = None
    """when the model's forward pass of this step began (None: no model hooked)"""
    last_submit: float = 0.0
    last_done: float = 0.0
    local_s: float = 0.0
    """sparsecomm's own local stages (selecting, encoding, flushing)"""
    first_issue: float | None = None
    """when the step's first dense all_reduce started"""
    wire_bytes: float = 0.0
    """what the step's large dense all_reduces put on each rank's link"""
    wire_s: float = 0.0
    """from the first dense all_reduce's start to the last large one's end"""
    payload_bytes: int = 0
    payload_nnz: int = 0
    whole_nnz: int = 0
    """nonzeros of parameters sent whole inside compressed calls (in ``payload_nnz`` too)"""
    planned_nnz: int = 0
    """the entries the step's density budgets in its compressed calls: its tensors may send more
    (`sparsecomm.sparsify.shared_threshold`), so the bytes per budgeted entry hold their extra"""
    fixed_bytes: int = 0
    """bytes of the calls outside the budget (small tensors, sparse rows)"""
    max_magnitude: float = 0.0
    """the largest |value| this rank sent (before any 1/P scaling)"""
    codec_cost: tuple[float, float] = (0.0, 0.0)
    """this rank's calibrated (κ_e, κ_d), carried by its reports"""
    total_numel: int = 0
    budget_numel: int = 0
    wants_energy: bool = False
    """whether this step samples its gradient's energy (`Planner.begin_step` decides)"""
    energy_samples: list[torch.Tensor] = field(default_factory=list)
    """squares of a strided sample of the gradient's entries under the budget"""
    host_memory: bool = False
    """whether a gradient of the step was in host memory (a CPU's)"""
    preferred_density: float | None = None
    """the density the samples prefer, where the step's last call read it with its own check
    (`Costs.energy_choice`); None: read when the step ends"""

    def submitted(self, numel: int, budget_numel: int, planned: int, whole_nnz: int, local_s: float,
                  now: float) -> None:
        """A call of ``numel`` entries, ``budget_numel`` of them under the density (``planned`` of those
        to be sent, ``whole_nnz`` nonzeros of parameters sent whole besides), whose local stages
        took ``local_s``."""
        self.local_s += local_s
        self.last_submit = now
        self.total_numel += numel
        self.budget_numel += budget_numel
        self.planned_nnz += planned
        self.whole_nnz += whole_nnz

    def issued_dense(self, now: float) -> None:
        """A dense all_reduce starts: the first starts the wire's clock."""
        if self.first_issue is None:
            self.first_issue = now

    def finished(self, now: float, nbytes: int, *, payload_nnz: int | None = None, in_budget: bool = False,
                 dense_wire: bool = False, world_size: int = 1, min_wire_bytes: int = 0) -> None:
        """A call finished having sent ``nbytes``: a payload of ``payload_nnz`` entries, else bytes
        under the budget (a dense step's flushed gradient) or outside it. A ``dense_wire`` call of at
        least ``min_wire_bytes`` times the link: a ring all_reduce puts 2(P−1)/P of the tensor on
        each rank's link."""
        self.last_done = max(self.last_done, now)
        if payload_nnz is not None:
            self.payload_bytes += nbytes
            self.payload_nnz += payload_nnz
        elif not in_budget:
            self.fixed_bytes += nbytes
        if dense_wire and nbytes >= min_wire_bytes and self.first_issue is not None:
            self.wire_bytes += 2 * (world_size - 1) / world_size * nbytes
            self.wire_s = now - self.first_issue

    def saw_magnitude(self, magnitude: float) -> None:
        self.max_magnitude = max(self.max_magnitude, magnitude)

    def forward_backward_s(self) -> float:
        """From the forward pass's start to the step's last call, less sparsecomm's local stages."""
        assert self.forward_start is not None
        return max(0.0, self.last_submit - self.forward_start - self.local_s)

    def compute_s(self, next_start: float) -> float:
        """Without a forward hook: from this step's first call to the next step's first call, less
        the communication it waited for and sparsecomm's local stages."""
        assert self.first_submit is not None
        waited = max(0.0, self.last_done - self.last_submit)
        return max(0.0, next_start - self.first_submit - waited - self.local_s)


def typical(samples: deque[float]) -> float:
    """The interquartile mean: the mean of the middle half of the samples, steadier than a median of
    few and blind to the odd step that a scheduling hiccup made several times longer. Below four
    samples there is no quarter to cut: their median (a mean would take a hiccup in whole)."""
    ordered = sorted(samples)
    if len(ordered) < 4:
        return statistics.median(ordered)
    cut = len(ordered) // 4
    middle = ordered[cut:len(ordered) - cut]
    return sum(middle) / len(middle)
