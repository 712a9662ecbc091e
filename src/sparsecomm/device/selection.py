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

On a processor the same choice is made a segment at a time in the CPU's own memory, where a
candidate count costs no wait: faster there than one comparison over the bucket.
"""

from __future__ import annotations

import numpy as np
import torch

from sparsecomm.device.indices import compact
from sparsecomm.device.layout import BucketLayout
from sparsecomm.sparsify.threshold import host_indices_at_or_above

TINY = 1e-30
"""the least threshold: a segment of zeros has no candidates, not every entry"""

SLACK = 3
"""candidates per entry of the capacity: twice what the thresholds aim at"""


def thresholds(accumulated: torch.Tensor, layout: BucketLayout, ratio: float,
               generator: torch.Generator) -> torch.Tensor:
    """Per segment, the threshold its entries' magnitudes are compared with (NaN, which no entry
    reaches, for segments sent whole and for the padding)."""
    grid = layout.at_ratio(ratio).grid
    per_segment = torch.full((len(layout.segments) + 1,), float("nan"), dtype=accumulated.dtype,
                             device=accumulated.device)
    if grid.base.numel() == 0:
        return per_segment
    offsets = torch.rand(grid.strides.shape, generator=generator, device=generator.device)
    offsets = offsets.to(accumulated.device).mul_(grid.strides).long()
    samples = accumulated[grid.base + offsets].abs_().masked_fill_(grid.padded, -1.0)
    top = torch.topk(samples, grid.deepest, dim=1).values
    chosen = top.gather(1, grid.ranks).squeeze(1).clamp_(min=TINY)
    return per_segment.index_copy_(0, layout.sparsified, chosen)


def select(accumulated: torch.Tensor, layout: BucketLayout, ratio: float,
           generator: torch.Generator) -> torch.Tensor:
    """The indices (int64, as many as the capacity at ``ratio``, ascending) of the sparsified entries
    to send, or ``numel`` for an unused slot. ``accumulated`` holds ``numel + 1`` entries, the last
    (the padding) zero; the entries sent whole (`BucketLayout.whole`) are never among them."""
    capacity = layout.at_ratio(ratio).capacity
    numel = layout.numel
    threshold = thresholds(accumulated, layout, ratio, generator)
    slots = min(numel, SLACK * capacity)
    if accumulated.device.type == "cpu" and accumulated.dtype == torch.float32:
        return _select_in_host_memory(accumulated[:numel].detach().numpy(), threshold.numpy(), layout, slots,
                                      capacity)
    return _select_on_device(accumulated, threshold, layout, slots, capacity)


def _select_on_device(accumulated: torch.Tensor, threshold: torch.Tensor, layout: BucketLayout, slots: int,
                      capacity: int) -> torch.Tensor:
    """`select` in a fixed number of tensor ops and no host read."""
    numel = layout.numel
    candidates = compact(accumulated[:numel].abs() >= threshold.index_select(0, layout.segment_ids[:numel]),
                         slots, fill=numel)
    if slots <= capacity:  # every entry is a candidate: the padding fills the rest
        return torch.cat([candidates, candidates.new_full((capacity - slots,), numel)])
    scores = accumulated[candidates].abs_() / threshold[layout.segment_ids[candidates].long()]
    scores = torch.where(candidates < numel, scores, -1.0)  # the padding: below every candidate
    least = torch.kthvalue(scores, slots - capacity + 1).values  # the capacity-th best score
    kept = compact((scores >= least) & (candidates < numel), capacity, fill=slots)
    # in index order, as the candidates are: a value codec's blocks then stay within a tensor
    return torch.cat([candidates, candidates.new_full((1,), numel)])[kept]


def _select_in_host_memory(values: np.ndarray, threshold: np.ndarray, layout: BucketLayout, slots: int,
                           capacity: int) -> torch.Tensor:
    """`select` on a processor, the same choice: a cache-blocked pass per sparsified segment that
    never writes the magnitudes out (`host_indices_at_or_above`), then scores and a k-th value over
    the candidates found alone (here their number costs no wait). Faster on a CPU than the device
    form's one comparison with a threshold gathered for every entry, whatever the segments."""
    found = [host_indices_at_or_above(values[s.start:s.start + s.numel], float(threshold[place])) + s.start
             for place, s in layout.sparsified_segments]
    candidates = np.concatenate(found)[:slots] if found else np.zeros(0, dtype=np.int64)
    if candidates.size > capacity:
        places = [place for place, _ in layout.sparsified_segments]
        scores = np.abs(values[candidates]) / np.repeat(threshold[places], [f.size for f in found])[:slots]
        cut = candidates.size - capacity
        least = np.partition(scores, cut)[cut]  # the capacity-th best score
        candidates = candidates[scores >= least][:capacity]
    chosen = np.full(capacity, layout.numel, dtype=np.int64)
    chosen[:candidates.size] = candidates
    return torch.from_numpy(chosen)
