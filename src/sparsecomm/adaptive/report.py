"""`Report`: what one rank measured in one step, in named fields. Reports travel as side numbers
(`sparsecomm.transport.side_numbers`), each rank's in field order; every rank takes the largest of
each field over the ranks (`Report.agreed`), so every rank plans from the same numbers: the
slowest compute, the fastest link, the dearest payloads and codecs, the largest magnitude.
Checkpoints hold reports by field name."""

from __future__ import annotations

import math
from dataclasses import asdict, astuple, dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class Report:
    """One step's numbers (0: not measured in that step)."""

    compute_s: float = 0.0
    """forward and backward (of this step; without a forward hook, of the step before)"""
    throughput: float = 0.0
    """wire bytes per second of the step's large dense all_reduce calls: of the ranks, the one
    that waited least for the others to post measured the link"""
    fp32_step_s: float = 0.0
    """an fp32 step's whole time: compute and communicating"""
    fp16_step_s: float = 0.0
    """the same for an fp16 step"""
    sparse_step_s: float = 0.0
    """a sparse step's whole time less its payloads' wire time and per-byte cost"""
    bytes_per_nnz: float = 0.0
    """a sparse step's payload bytes per entry the density budgeted (what tensors sent above it
    included)"""
    fixed_bytes: float = 0.0
    """a sparse step's bytes outside the budget (small tensors, parameters sent whole, sparse rows)"""
    max_magnitude: float = 0.0
    """the largest |value| sent"""
    encode_per_byte: float = 0.0
    """this rank's calibrated seconds per payload byte, sending"""
    decode_per_byte: float = 0.0
    """and receiving"""
    preferred_density: float = 0.0
    """the density this rank's sampled gradient preferred (`Costs.energy_density`)"""
    device_route: float = 0.0
    """1 where the step was a ``device`` one: its sparse step's fields are the device route's"""
    host_memory: float = 0.0
    """1 where this rank's gradients were in host memory (agreed: where any rank's were)"""
    low_rank_step_s: float = 0.0
    """a low-rank step's whole time: compute and communicating (the fields travel in this order,
    and format-0 checkpoints held them so: a new field goes last)"""

    def __post_init__(self) -> None:
        if not 0.0 <= self.throughput < math.inf:  # no throughput was measured, or none that means one
            object.__setattr__(self, "throughput", 0.0)

    def numbers(self) -> tuple[float, ...]:
        """The fields in order, as they travel."""
        return astuple(self)

    @classmethod
    def from_numbers(cls, numbers: torch.Tensor | tuple[float, ...] | list[float]) -> Report:
        values = numbers.tolist() if isinstance(numbers, torch.Tensor) else list(numbers)
        return cls(*(float(value) for value in values[:len(fields(cls))]))

    @classmethod
    def agreed(cls, rows: torch.Tensor) -> Report:
        """The agreed report from every rank's numbers (world size × at least the fields): each
        field's largest."""
        return cls.from_numbers(rows[:, :len(fields(cls))].amax(0))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> Report:
        return cls(**{name: float(value) for name, value in state.items()})


def report_width() -> int:
    """The numbers a `Report` travels as."""
    return len(fields(Report))
