"""`select`: a bucket's capacity's worth of entries, chosen on the device in a fixed number of ops.

Each sparsified segment's threshold is DGC's, sampled, and set where about twice its count stand
above it (`sparsecomm.device.layout`). One pass marks the entries above their own segment's
threshold, and a fixed-size compaction keeps the first `SLACK` times the capacity of them: the
candidates. Each is scored by its magnitude over its threshold, so scores compare across tensors.
Among them each segment keeps its own top count — DGC's top-k per tensor, whenever its top
entries are among the candidates — and what is left of the capacity (where a tensor had fewer
candidates than its count) goes to the best of the rest. So a rank's selection has the same size
every step; where there are fewer candidates than the capacity, the rest of it names the padding
entry at ``numel``, which holds zero. The entries sent whole go besides, by their fixed indices.

The thresholds sample enough (`SAMPLED_ABOVE`) that more candidates than the compaction keeps —
twice what is expected — come about once in a million tensor-steps; then the earliest are kept,
and what the rest would have sent stays in the feedback for a later step.
"""

from __future__ import annotations

import torch

from sparsecomm.device.indices import compact
from sparsecomm.device.layout import BucketLayout

TINY = 1e-30
"""the least threshold: a segment of zeros has no candidates, not every entry"""

SLACK = 4
"""candidates per entry of the capacity: twice what the thresholds aim at"""

FEW_SEGMENTS = 8
"""on a CPU, up to this many sparsified segments are compared one by one: a few ops, each on a large
tensor, cost less than gathering a threshold for every entry"""


def thresholds(magnitudes: torch.Tensor, layout: BucketLayout, ratio: float,
               generator: torch.Generator) -> torch.Tensor:
    """Per segment, the threshold its entries are compared with (NaN, which no entry reaches, for
    segments sent whole and for the padding)."""
    grid, _ = layout.at_ratio(ratio)
    per_segment = torch.full((len(layout.segments) + 1,), float("nan"), dtype=magnitudes.dtype,
                             device=magnitudes.device)
    if grid.base.numel() == 0:
        return per_segment
    offsets = torch.rand(grid.strides.shape, generator=generator, device=generator.device)
    offsets = offsets.to(magnitudes.device).mul_(grid.strides).long()
    samples = magnitudes[grid.base + offsets].masked_fill_(grid.padded, -1.0)
    top = torch.topk(samples, grid.deepest, dim=1).values
    chosen = top.gather(1, grid.ranks).squeeze(1).clamp_(min=TINY)
    return per_segment.index_copy_(0, layout.sparsified, chosen)


def select(accumulated: torch.Tensor, layout: BucketLayout, ratio: float,
           generator: torch.Generator) -> torch.Tensor:
    """The indices (int64, as many as the capacity at ``ratio``, ascending) of the sparsified entries
    to send, or ``numel`` for an unused slot. ``accumulated`` holds ``numel + 1`` entries, the last
    (the padding) zero; the entries sent whole (`BucketLayout.whole`) are never among them."""
    _, capacity = layout.at_ratio(ratio)
    numel = layout.numel
    magnitudes = accumulated.abs()
    threshold = thresholds(magnitudes, layout, ratio, generator)
    above = _above(magnitudes[:numel], threshold, layout)
    candidates = compact(above, SLACK * capacity, fill=numel)
    segment = layout.segment_ids[candidates].long()
    scores = magnitudes[candidates] / threshold[segment]
    scores = torch.where(candidates < numel, scores, -1.0)  # the padding: below every candidate
    # by segment, best first: each candidate's rank within its segment
    best_first = torch.argsort(scores, descending=True, stable=True)
    by_segment = torch.argsort(segment[best_first], stable=True)
    best_first = best_first[by_segment]
    ordered = segment[best_first]
    rank = torch.arange(ordered.numel(), device=ordered.device) - torch.searchsorted(ordered, ordered)
    kept = rank < layout.counts(ratio)[ordered]
    priority = torch.where(kept, float("inf"), scores[best_first])
    chosen = candidates[best_first[torch.topk(priority, capacity, sorted=False).indices]]
    return torch.sort(chosen).values  # in index order: a value codec's blocks then stay within a tensor


def _above(magnitudes: torch.Tensor, threshold: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
    """Whether each entry reaches its segment's threshold: one comparison with the thresholds
    gathered per entry, or on a CPU, where that gather costs more than the comparison, one
    comparison per sparsified segment where there are few (no host read either way: each
    threshold stays a tensor)."""
    segments = layout.sparsified_segments
    if magnitudes.device.type != "cpu" or len(segments) > FEW_SEGMENTS:
        return magnitudes >= threshold.index_select(0, layout.segment_ids[:layout.numel])
    above = torch.zeros(layout.numel, dtype=torch.bool)
    for index, segment in segments:
        end = segment.start + segment.numel
        torch.ge(magnitudes[segment.start:end], threshold[index], out=above[segment.start:end])
    return above
