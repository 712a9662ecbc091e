"""`select`: a bucket's capacity's worth of entries, chosen on the device in a fixed number of ops.

Each sparsified segment's threshold is DGC's, sampled, and set where about `CANDIDATES` times its
count stand above it (`sparsecomm.device.layout`). One pass marks the entries above their own
segment's threshold, and a fixed-size compaction keeps the first `SLACK` times the capacity of
them: the candidates. Each is scored by its magnitude over its threshold, so scores compare across
tensors, and the capacity's best scores are kept: one selection (a k-th value, no sort) in which
each tensor's share is near its count — DGC's top-k per tensor, its count near k, as DGC's own
sampled threshold gives. So a rank's selection has the same size every step; where there are fewer
candidates than the capacity, the rest of it names the padding entry at ``numel``, which holds
zero. The entries sent whole go besides, by their fixed indices.

The thresholds sample enough (`SAMPLED_ABOVE`) that more candidates than the compaction keeps —
twice what is expected — come about once in a million tensor-steps; then the earliest are kept,
and what the rest would have sent stays in the feedback for a later step.

`select_shared` (``adaptive``'s) lowers a segment's threshold to one over the whole bucket where
that is lower, so a tensor whose gradient stands out sends more than its floor
(`sparsecomm.device.shares`).

On a processor the same choice is made a segment at a time in the CPU's own memory, where a
candidate count costs no wait: faster there than one comparison over the bucket.
"""

from __future__ import annotations

import numpy as np
import torch

from sparsecomm.device import shares
from sparsecomm.device.indices import compact
from sparsecomm.device.layout import TINY, BucketLayout, SampleGrid
from sparsecomm.sparsify.threshold import host_indices_at_or_above

SLACK = 3
"""candidates per entry of the capacity: twice what the thresholds aim at"""


def thresholds(accumulated: torch.Tensor, layout: BucketLayout, ratio: float,
               generator: torch.Generator) -> torch.Tensor:
    """Per segment, the threshold its entries' magnitudes are compared with (NaN, which no entry
    reaches, for segments sent whole and for the padding)."""
    return _per_segment(layout, accumulated, _own(accumulated, layout.at_ratio(ratio).grid, generator))


def select(accumulated: torch.Tensor, layout: BucketLayout, ratio: float,
           generator: torch.Generator) -> torch.Tensor:
    """The indices (int64, as many as the capacity at ``ratio``, ascending) of the sparsified entries
    to send, or ``numel`` for an unused slot. ``accumulated`` holds ``numel + 1`` entries, the last
    (the padding) zero; the entries sent whole (`BucketLayout.whole`) are never among them."""
    at = layout.at_ratio(ratio)
    own = _own(accumulated, at.grid, generator)
    if _in_host_memory(accumulated):
        host = own.numpy() if own is not None else None
        return _select_in_host_memory(accumulated, host, host, layout, at.capacity)
    threshold = _per_segment(layout, accumulated, own)
    return _select_on_device(accumulated, threshold, threshold, layout, at.capacity)


def select_shared(accumulated: torch.Tensor, layout: BucketLayout, ratio: float, share: float,
                  generator: torch.Generator, within: bool = False) -> tuple[torch.Tensor, torch.Tensor | float]:
    """`select` with every segment's floor and one threshold over the bucket besides
    (`sparsecomm.device.shares`): floors at ``ratio`` in the capacity at ``ratio`` times ``share``,
    or, ``within`` that capacity, floors at ``ratio`` over ``share``. And the share this rank's
    gradient proposes for the next step (a 0-d float32 on the device, or a float where the choice
    was made in host memory)."""
    floors = ratio / shares.rounded(share) if within else ratio
    capacity = shares.capacity_at(layout, ratio, 1.0 if within else share)
    grid = layout.at_ratio(floors).grid
    samples = _sampled(accumulated, grid, generator)
    if samples is None:
        return select(accumulated, layout, ratio, generator), 1.0
    both = _at_ranks(samples, grid, grid.both_ranks)
    if _in_host_memory(accumulated):
        own_floor = both.numpy()
        lowest, scale, own_share = shares.lowered_in_host_memory(samples.numpy(), grid, own_floor[:, 0],
                                                                 own_floor[:, 1])
        return _select_in_host_memory(accumulated, lowest, scale, layout, capacity), own_share
    candidates, members, proposed = shares.lowered(samples, grid, *both.unbind(1))
    return _select_on_device(accumulated, _per_segment(layout, accumulated, candidates),
                             _per_segment(layout, accumulated, members), layout, capacity), proposed


def _own(accumulated: torch.Tensor, grid: SampleGrid, generator: torch.Generator) -> torch.Tensor | None:
    """Each sparsified segment's own threshold, where `CANDIDATES` times its count stand above it
    (None: no segment is sparsified)."""
    samples = _sampled(accumulated, grid, generator)
    return _at_ranks(samples, grid, grid.ranks).squeeze(1) if samples is not None else None


def _sampled(accumulated: torch.Tensor, grid: SampleGrid, generator: torch.Generator) -> torch.Tensor | None:
    """Each sparsified segment's sampled magnitudes, a row each, -1 where padded (None: none)."""
    if grid.base.numel() == 0:
        return None
    offsets = torch.rand(grid.strides.shape, generator=generator, device=generator.device)
    offsets = offsets.to(accumulated.device).mul_(grid.strides).long()
    return accumulated[grid.base + offsets].abs_().masked_fill_(grid.padded, -1.0)


def _at_ranks(samples: torch.Tensor, grid: SampleGrid, ranks: torch.Tensor) -> torch.Tensor:
    """Each row's samples at ``ranks`` (a column each, counted from the largest, from 0; no deeper
    than the grid's thresholds)."""
    top = torch.topk(samples, grid.deepest, dim=1).values
    return top.gather(1, ranks).clamp_(min=TINY)


def _per_segment(layout: BucketLayout, accumulated: torch.Tensor, sparsified: torch.Tensor | None) -> torch.Tensor:
    per_segment = torch.full((len(layout.segments) + 1,), float("nan"), dtype=accumulated.dtype,
                             device=accumulated.device)
    return per_segment if sparsified is None else per_segment.index_copy_(0, layout.sparsified, sparsified)


def _in_host_memory(accumulated: torch.Tensor) -> bool:
    return accumulated.device.type == "cpu" and accumulated.dtype == torch.float32


def _select_on_device(accumulated: torch.Tensor, threshold: torch.Tensor, scale: torch.Tensor, layout: BucketLayout,
                      capacity: int) -> torch.Tensor:
    """`select` in a fixed number of tensor ops and no host read: the candidates at or above their
    segment's ``threshold``; past the capacity, those whose magnitude over their segment's ``scale``
    is largest (both per segment, `_per_segment`)."""
    numel = layout.numel
    slots = min(numel, SLACK * capacity)
    candidates = compact(accumulated[:numel].abs() >= threshold.index_select(0, layout.segment_ids[:numel]),
                         slots, fill=numel)
    if slots <= capacity:  # every entry is a candidate: the padding fills the rest
        return torch.cat([candidates, candidates.new_full((capacity - slots,), numel)])
    scores = accumulated[candidates].abs_() / scale[layout.segment_ids[candidates].long()]
    scores = torch.where(candidates < numel, scores, -1.0)  # the padding: below every candidate
    least = torch.kthvalue(scores, slots - capacity + 1).values  # the capacity-th best score
    kept = compact((scores >= least) & (candidates < numel), capacity, fill=slots)
    # in index order, as the candidates are: a value codec's blocks then stay within a tensor
    return torch.cat([candidates, candidates.new_full((1,), numel)])[kept]


def _select_in_host_memory(accumulated: torch.Tensor, threshold: np.ndarray | None, scale: np.ndarray | None,
                           layout: BucketLayout, capacity: int) -> torch.Tensor:
    """`select` on a processor, the same choice: a cache-blocked pass per sparsified segment that
    never writes the magnitudes out (`host_indices_at_or_above`), then scores and a k-th value over
    the candidates found alone (here their number costs no wait). Faster on a CPU than the device
    form's one comparison with a threshold gathered for every entry, whatever the segments.
    ``threshold`` and ``scale``: one per sparsified segment (None: there are none)."""
    values = accumulated[:layout.numel].detach().numpy()
    slots = min(layout.numel, SLACK * capacity)
    found = [host_indices_at_or_above(values[s.start:s.start + s.numel], float(threshold[i])) + s.start
             for i, (_, s) in enumerate(layout.sparsified_segments)] if threshold is not None else []
    candidates = np.concatenate(found)[:slots] if found else np.zeros(0, dtype=np.int64)
    if candidates.size > capacity:
        assert scale is not None
        scores = np.abs(values[candidates]) / np.repeat(scale, [f.size for f in found])[:slots]
        cut = candidates.size - capacity
        least = np.partition(scores, cut)[cut]  # the capacity-th best score
        candidates = candidates[scores >= least][:capacity]
    chosen = np.full(capacity, layout.numel, dtype=np.int64)
    chosen[:candidates.size] = candidates
    return torch.from_numpy(chosen)
