"""`select`: a bucket's capacity's worth of entries, chosen on the device in a fixed number of ops.

Each sparsified segment's threshold is DGC's: a sampled magnitude near its count's. Every entry
is scored by its magnitude over its segment's threshold, so scores compare across tensors, and
the top `SLACK` times the capacity are the candidates. Among them each segment keeps its own top
count — DGC's top-k per tensor, whenever a tensor's top entries are among the candidates — and
what is left of the capacity (where a tensor had fewer candidates than its count) goes to the best
of the rest. So a rank's selection has the same size every step; the entries sent whole go
besides, by their fixed indices.
"""

from __future__ import annotations

import torch

from sparsecomm.device.layout import BucketLayout

TINY = 1e-30
"""the least threshold: a segment of zeros scores zero, not NaN"""

SLACK = 4
"""candidates per entry of the capacity: room for each tensor's top count when thresholds err"""


def thresholds(magnitudes: torch.Tensor, layout: BucketLayout, ratio: float,
               generator: torch.Generator) -> torch.Tensor:
    """Per segment, the threshold its entries are scored against (infinity for segments sent whole)."""
    grid, _ = layout.at_ratio(ratio)
    per_segment = torch.full((len(layout.segments),), float("inf"), dtype=magnitudes.dtype, device=magnitudes.device)
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
    """The indices (int64, as many as the capacity at ``ratio``) of the sparsified entries to send;
    the entries sent whole (`BucketLayout.whole`) are never among them."""
    _, capacity = layout.at_ratio(ratio)
    magnitudes = accumulated.abs()
    scale = thresholds(magnitudes, layout, ratio, generator).reciprocal_()
    scores = magnitudes.mul_(torch.repeat_interleave(scale, layout.sizes, output_size=layout.numel))
    whole = 0
    if layout.whole is not None:
        whole = layout.whole.numel()
        scores.index_fill_(0, layout.whole, -1.0)  # below every sparsified entry's score
    candidates = torch.topk(scores, min(SLACK * capacity, layout.numel - whole), sorted=False).indices
    # by segment, best first: each entry's rank within its segment
    best_first = candidates[torch.argsort(scores[candidates], descending=True, stable=True)]
    segment = torch.searchsorted(layout.starts, best_first, right=True) - 1
    by_segment = torch.argsort(segment, stable=True)
    best_first, segment = best_first[by_segment], segment[by_segment]
    rank = torch.arange(segment.numel(), device=segment.device) - torch.searchsorted(segment, segment)
    kept = rank < layout.counts(ratio)[segment]
    priority = torch.where(kept, float("inf"), scores[best_first])
    return best_first[torch.topk(priority, capacity, sorted=False).indices]
