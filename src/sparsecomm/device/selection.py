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
"""

from __future__ import annotations

import torch

from sparsecomm.device.indices import compact
from sparsecomm.device.layout import BucketLayout
from sparsecomm.sparsify.threshold import indices_at_or_above

TINY = 1e-30
"""the least threshold: a segment of zeros has no candidates, not every entry"""

SLACK = 3
"""candidates per entry of the capacity: twice what the thresholds aim at"""

FEW_SEGMENTS = 8
"""on a CPU, up to this many sparsified segments are compared one by one: a few passes, each on a
large tensor, cost less than gathering a threshold for every entry"""


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
    candidates = _candidates(accumulated[:numel], threshold, layout, slots)
    if slots <= capacity:  # every entry is a candidate: the padding fills the rest
        return torch.cat([candidates, candidates.new_full((capacity - slots,), numel)])
    scores = accumulated[candidates].abs_() / threshold[layout.segment_ids[candidates].long()]
    scores = torch.where(candidates < numel, scores, -1.0)  # the padding: below every candidate
    least = torch.kthvalue(scores, slots - capacity + 1).values  # the capacity-th best score
    kept = compact((scores >= least) & (candidates < numel), capacity, fill=slots)
    # in index order, as the candidates are: a value codec's blocks then stay within a tensor
    return torch.cat([candidates, candidates.new_full((1,), numel)])[kept]


def _candidates(values: torch.Tensor, threshold: torch.Tensor, layout: BucketLayout, slots: int) -> torch.Tensor:
    """The first ``slots`` entries (ascending; ``numel`` where there are fewer) whose magnitude
    reaches their segment's threshold. On a CPU with few sparsified segments, a cache-blocked pass
    per segment that never writes the magnitudes out (`indices_at_or_above`; the thresholds are
    read from the CPU's own memory, no device to wait for); elsewhere one comparison with the
    thresholds gathered per entry, then a fixed-size compaction."""
    segments = layout.sparsified_segments
    numel = layout.numel
    if values.device.type != "cpu" or len(segments) > FEW_SEGMENTS or values.dtype != torch.float32:
        above = values.abs() >= threshold.index_select(0, layout.segment_ids[:numel])
        return compact(above, slots, fill=numel)
    levels = threshold.numpy()
    found = [indices_at_or_above(values[s.start:s.start + s.numel], float(levels[index])).add_(s.start)
             for index, s in segments]
    chosen = torch.cat(found)[:slots] if found else torch.zeros(0, dtype=torch.int64)
    return torch.nn.functional.pad(chosen, (0, slots - chosen.numel()), value=numel)
