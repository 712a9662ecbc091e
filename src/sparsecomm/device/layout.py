"""`BucketLayout`: what a bucket's device pass needs that stays fixed from step to step — its
segments' sizes, which are sent whole, where each threshold samples, and its capacity at a ratio."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from sparsecomm.pipeline import Segment
from sparsecomm.sparsify.base import count_from
from sparsecomm.transport.collectives import fingerprint

SAMPLES = 1024
"""magnitudes sampled per tensor for its threshold, at least (all of a smaller tensor's)"""
SAMPLED_ABOVE = 32
"""and enough that about this many samples stand above it: its count then errs by about 1/√32"""
CANDIDATES = 1.5
"""a tensor's threshold is set where about this many times its count stand above it"""
TINY = 1e-30
"""the least threshold: a segment of zeros has no candidates, not every entry"""
POOLED = 32768
"""samples, at most, from which one threshold over the bucket is found (a sort of them per call)"""


@dataclass(frozen=True)
class SampleGrid:
    """Where each sparsified segment's threshold samples: row i holds segment i's strided positions
    (``base`` plus a random offset below ``strides[i]`` each step), padded to one width; ``padded``
    marks the padding. ``ranks[i]``: which sample, counted from the largest, is the threshold."""

    base: torch.Tensor
    strides: torch.Tensor
    padded: torch.Tensor
    ranks: torch.Tensor
    width: int
    deepest: int
    both_ranks: torch.Tensor
    """``ranks``, and which sample stands where the segment's count itself does (two columns)"""
    floors: torch.Tensor
    """each segment's count at the ratio (float32): its floor where one threshold over the bucket
    shares the density out (`sparsecomm.device.shares`)"""
    floor_count: float
    """the floors' sum"""
    pooled_step: int
    """every this-many-th column of the samples goes into the bucket's pool (`POOLED` of them at most)"""
    pooled_weights: torch.Tensor
    """the entries each pooled sample stands for (float32, the pool's shape; 0 where padded)"""
    reaches: torch.Tensor
    """the floors' sum and `CANDIDATES` times it (float32): how many entries of the whole bucket
    stand above its threshold, and above the threshold its candidates are compared with"""

    @cached_property
    def in_host_memory(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``pooled_weights``, ``reaches`` and ``floors`` as numpy arrays (a grid on a processor)."""
        return self.pooled_weights.numpy(), self.reaches.numpy(), self.floors.numpy()


@dataclass(frozen=True)
class AtRatio:
    """A bucket's selection at one ratio: where its thresholds sample, and its capacity (each
    sparsified segment's count, ceil(ratio·numel); the entries sent whole go besides)."""

    grid: SampleGrid
    capacity: int


RATIOS_KEPT = 8
"""a layout keeps its selections at this many ratios, the latest (``adaptive`` plans a new density
in its warm-up's every step)"""


@dataclass
class BucketLayout:
    """A bucket of ``numel`` entries split into ``segments`` (each parameter, in order); those
    ``whole`` go with every entry, the others through the threshold at the sparsifier's ratio."""

    segments: tuple[Segment, ...]
    numel: int
    device: torch.device
    whole: torch.Tensor | None = field(init=False)
    """the indices of the entries sent whole (None: none are)"""
    sparsified_segments: list[tuple[int, Segment]] = field(init=False)
    """each sparsified segment (not sent whole, not empty) with its place among ``segments``"""
    sparsified: torch.Tensor = field(init=False)
    """the same places, on the device"""
    segment_ids: torch.Tensor = field(init=False)
    """each entry's segment, and for the padding entry at ``numel`` (the place every unused slot of
    a selection names) one past the last (int32: a gather by it is cheaper than repeating
    per-segment values)"""
    digest: int = field(init=False)
    _ratios: dict[float, AtRatio] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        device = self.device
        whole = [torch.arange(s.start, s.start + s.numel, dtype=torch.int64) for s in self.segments if s.whole]
        self.whole = torch.cat(whole).to(device) if whole else None
        self.sparsified_segments = [(i, s) for i, s in enumerate(self.segments) if not s.whole and s.numel]
        self.sparsified = torch.tensor([i for i, _ in self.sparsified_segments], dtype=torch.int64, device=device)
        sizes = torch.tensor([s.numel for s in self.segments] + [1], dtype=torch.int64)  # and the padding
        self.segment_ids = torch.repeat_interleave(torch.arange(len(self.segments) + 1, dtype=torch.int32), sizes,
                                                   output_size=self.numel + 1).to(device)
        self.digest = fingerprint(self.numel, [(s.start, s.numel, s.whole) for s in self.segments])

    @classmethod
    def of(cls, segments: Sequence[Segment], numel: int, device: torch.device) -> BucketLayout:
        return cls(tuple(segments), numel, device)

    @property
    def sparsified_numel(self) -> int:
        """The entries the selection chooses from (those not sent whole)."""
        return sum(s.numel for _, s in self.sparsified_segments)

    def at_ratio(self, ratio: float) -> AtRatio:
        """The selection at ``ratio`` (built once, and kept among the latest `RATIOS_KEPT`)."""
        kept = self._ratios.pop(ratio, None)
        if kept is None:
            kept = AtRatio(self._grid(ratio), sum(count_from(s.numel, ratio, None) for s in self.segments
                                                  if not s.whole))
            if len(self._ratios) >= RATIOS_KEPT:
                self._ratios.pop(next(iter(self._ratios)))  # the least recently used
        self._ratios[ratio] = kept
        return kept

    def _grid(self, ratio: float) -> SampleGrid:
        sparsified = [s for _, s in self.sparsified_segments]
        above = [min(s.numel, CANDIDATES * count_from(s.numel, ratio, None)) for s in sparsified]
        counts = [min(s.numel, max(SAMPLES, math.ceil(SAMPLED_ABOVE * s.numel / n)))
                  for s, n in zip(sparsified, above, strict=True)]
        width = max(counts, default=1)
        strides = [s.numel // count for s, count in zip(sparsified, counts, strict=True)]
        columns = torch.arange(width, dtype=torch.int64)
        base = torch.stack([s.start + columns.clamp(max=count - 1) * stride
                            for s, count, stride in zip(sparsified, counts, strides, strict=True)]) \
            if sparsified else torch.zeros(0, width, dtype=torch.int64)
        padded = columns[None, :] >= torch.tensor(counts, dtype=torch.int64)[:, None] if sparsified \
            else torch.zeros(0, width, dtype=torch.bool)
        ranks = [_rank(count, n, s.numel) for s, count, n in zip(sparsified, counts, above, strict=True)]
        floors = [count_from(s.numel, ratio, None) for s in sparsified]
        floor_ranks = [_rank(count, n, s.numel) for s, count, n in zip(sparsified, counts, floors, strict=True)]
        step = max(1, -(-len(sparsified) * width // POOLED))
        pooled = torch.tensor([s.numel / -(-count // step) for s, count in zip(sparsified, counts, strict=True)],
                              dtype=torch.float32)
        device = self.device
        both = torch.tensor(list(zip(ranks, floor_ranks, strict=True)), dtype=torch.int64).reshape(-1, 2) - 1
        return SampleGrid(base.to(device), torch.tensor(strides, dtype=torch.int64, device=device)[:, None],
                          padded.to(device), both[:, :1].contiguous().to(device), width, max(ranks, default=1),
                          both.to(device), torch.tensor(floors, dtype=torch.float32, device=device),
                          float(sum(floors)), step,
                          torch.where(padded[:, ::step], 0.0, pooled[:, None]).contiguous().to(device),
                          torch.tensor([sum(floors), CANDIDATES * sum(floors)], dtype=torch.float32, device=device))


def _rank(samples: int, above: float, numel: int) -> int:
    """Which of ``samples`` (counted from the largest, from 1) stands where ``above`` of ``numel``
    entries do: the sample's share of them."""
    return min(samples, max(1, math.ceil(samples * above / numel - 1e-9)))
