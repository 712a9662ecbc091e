"""One threshold over the bucket: how ``adaptive``'s density is shared out on the device route.

As on the host path (`sparsecomm.sparsify.shared_threshold`), every tensor has a floor, and a
tensor also sends its entries that stand above the threshold at which the floors' count of the
whole bucket would be taken: a small matrix whose gradient is large next to the rest sends more
than its floor. A bucket's segments are all at hand in one call, so the threshold is this step's,
found from the samples each segment's own threshold has drawn, each weighted by the entries it
stands for: a sort of a bounded pool of them (`sparsecomm.device.layout.POOLED`), no host read.

Floors and threshold together take *share* times the floors' count, in [1, 2]. Every rank's
buffer has one size, so the share is agreed: each rank proposes the share its gradient asks for in
its buffer's header (`sparsecomm.device.wire`), and the next step's capacity is the floors' count
times the largest share any rank proposed, rounded up to a `SHARE_STEPS`-th — as on the host
path, the density is every tensor's floor. Under a byte budget a user set, the capacity is the
planned density's instead (the budget holds to the byte) and the floors are the density over this
rank's own share: the threshold takes the rest.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparsecomm.device.cumulative import cumulative
from sparsecomm.device.layout import TINY, BucketLayout, SampleGrid

MAX_SHARE = 2.0
"""floor and threshold take at most twice the floor's count: each takes at most the count"""
SHARE_STEPS = 16
"""a share is rounded up to a multiple of 1/SHARE_STEPS: a bucket then has few capacities"""


def rounded(share: float) -> float:
    """``share`` clamped to [1, `MAX_SHARE`] and rounded up to a multiple of 1/`SHARE_STEPS`."""
    if not share > 1.0:  # NaN included
        return 1.0
    return min(MAX_SHARE, math.ceil(share * SHARE_STEPS - 1e-9) / SHARE_STEPS)


def capacity_at(layout: BucketLayout, ratio: float, share: float) -> int:
    """A selection's slots: the floors' count at ``ratio`` times ``share`` (rounded)."""
    return min(layout.sparsified_numel, math.ceil(layout.at_ratio(ratio).capacity * rounded(share)))


def lowered(samples: torch.Tensor, grid: SampleGrid, candidates: torch.Tensor,
            members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sparsified segment's thresholds lowered to the bucket's where those are lower, and the
    share this rank's gradient proposes (a 0-d float32), in tensor ops of fixed sizes.

    ``candidates``: each segment's own threshold where `sparsecomm.device.layout.CANDIDATES` times
    its floor stand above it, ``members`` where its floor does; the bucket's where as many times the
    floors' count does, and where the floors' count does. An entry at or above its segment's
    lowered ``members`` threshold is one the floors and the bucket's threshold take. The share:
    each segment's floor or its entries above the bucket's threshold, whichever is more, summed,
    over the floors' count. ``samples``: the segments' sampled magnitudes, -1 where padded."""
    pool = samples[:, ::grid.pooled_step]
    order = pool.reshape(-1).sort(descending=True, stable=True)
    reach = cumulative(grid.pooled_weights.view(-1)[order.indices])  # the bucket's entries at or above each
    # a 0-d index would be read on the host: the magnitudes at both reaches, gathered as a pair
    at_floors, for_candidates = order.values.index_select(
        0, torch.searchsorted(reach, grid.reaches).clamp_(max=reach.numel() - 1)).clamp_(min=TINY).unbind()
    above = (grid.pooled_weights * (pool >= at_floors)).sum(1)
    share = torch.maximum(above, grid.floors).sum().mul_(1.0 / grid.floor_count)
    return torch.minimum(candidates, for_candidates), torch.minimum(members, at_floors), share


def lowered_in_host_memory(samples: np.ndarray, grid: SampleGrid, candidates: np.ndarray,
                           members: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """`lowered` on a processor, the same thresholds by numpy: there each tensor op of the device
    form would cost more than its work. Only the pool's head is sorted (`_descending_head`)."""
    pool = samples[:, ::grid.pooled_step]
    weights, reaches, floors = grid.in_host_memory
    flat = pool.reshape(-1)
    order = _descending_head(flat, weights.reshape(-1), float(reaches[-1]))
    reach = np.cumsum(weights.reshape(-1)[order], dtype=np.float32)
    at = np.searchsorted(reach, reaches)
    if at[-1] >= reach.size:  # the head fell short (it never does unless the whole pool is short): all of it
        order = np.argsort(-flat, kind="stable")
        reach = np.cumsum(weights.reshape(-1)[order], dtype=np.float32)
        at = np.searchsorted(reach, reaches)
    at = np.minimum(at, reach.size - 1)
    at_floors, for_candidates = np.maximum(flat[order[at]], TINY)
    above = (weights * (pool >= at_floors)).sum(1, dtype=np.float32)
    share = float(np.maximum(above, floors).sum(dtype=np.float32)) / grid.floor_count
    return np.minimum(candidates, for_candidates), np.minimum(members, at_floors), share


def _descending_head(pool: np.ndarray, weights: np.ndarray, reach: float) -> np.ndarray:
    """The first places of ``pool``'s stable descending order (largest first, ties in place
    order) whose ``weights`` add up to ``reach``, and perhaps a few more: every entry at or above
    the value at the place that many of the lightest weight would take. A partition finds that
    value, and only those entries are sorted: the same places a full sort starts with."""
    lightest = weights[weights > 0].min(initial=np.inf)
    head = int(math.ceil(reach / lightest)) + 1 if math.isfinite(lightest) else pool.size
    if head >= pool.size:
        return np.argsort(-pool, kind="stable")
    least = np.partition(pool, pool.size - head)[pool.size - head]  # the head-th largest
    places = np.flatnonzero(pool >= least)
    return places[np.argsort(-pool[places], kind="stable")]
