"""`select`: a bucket's capacity's worth of entries, chosen on the device in a fixed number of ops.

Each sparsified segment's threshold is DGC's: the sampled magnitude that about its count of
entries pass. Every entry is scored by its magnitude over its segment's threshold, and the
capacity's top scores go (the entries sent whole go besides, by their fixed indices). So each
tensor sends about its own count, a rank's selection has the same size every step, and where more
pass their thresholds than fit (or fewer), the ones furthest above (or nearest below) go, the rest
staying in the feedback.
"""

from __future__ import annotations

import torch

from sparsecomm.device.layout import BucketLayout

TINY = 1e-30
"""the least threshold: a segment of zeros scores zero, not NaN"""


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
    if layout.whole is not None:
        scores.index_fill_(0, layout.whole, -1.0)  # below every sparsified entry's score
    return torch.topk(scores, capacity, sorted=False).indices
