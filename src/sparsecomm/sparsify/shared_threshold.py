"""Entries that stand above the rest of the model: how the ``adaptive`` density is shared out.

A step's plan sets one density d for the N entries it budgets. Taken per tensor, d gives every
tensor the same share of its entries, whatever its gradient: a small hidden matrix whose every entry
sums over the whole output layer gets as few as the output layer's own, where one threshold over
both layers would take several times that many. So d is every tensor's floor, and a tensor also
sends the entries that stand above the threshold at which d·N entries of the whole model would be
taken — the selection the energy curve that set d assumes (`sparsecomm.adaptive.costs`,
`Costs.energy_density`). A floor, not a redistribution: a pure common threshold would take
the large layer's entries to pay for the small one's, and those entries are worth more to the
loss than their magnitude says.

A step's tensors reach the pipeline one call at a time, the first before the last is computed, so
the threshold is read from the step before: each tensor keeps a strided sample of its accumulated
magnitudes (what its selection looks at), and when the step ends, the threshold that keeps d·N
entries over every sample (each entry weighted by the entries it stands for) gives each tensor its
*share*: the fraction of its sample above the threshold over d, at least 1. The next step selects
d'·share from each, d' its own planned density. Each rank shares out its own entries (the counts
may differ between ranks, which an allgather carries): nothing here needs an agreement.
"""

from __future__ import annotations

import torch

from sparsecomm.device.cumulative import cumulative

SAMPLE_STRIDE = 100
"""every this-many-th entry of a tensor's accumulated gradient is sampled (at least `MIN_SAMPLED`)"""
MIN_SAMPLED = 256
"""a tensor is sampled at a stride that leaves at least this many of its entries (all, if fewer)"""
BINS_PER_OCTAVE = 8
"""the threshold is found by a histogram of eighth-octave bins (no sort), entries of its own bin
counted in proportion"""


def magnitude_sample(accumulated: torch.Tensor, step: int) -> torch.Tensor:
    """|entries| of ``accumulated`` at a stride (its offset turning with ``step``), as float32."""
    flat = accumulated.reshape(-1)
    stride = max(1, min(SAMPLE_STRIDE, flat.numel() // MIN_SAMPLED))
    return flat[step % stride::stride].detach().abs().to(torch.float32)


def density_shares(sampled: dict[str, tuple[int, torch.Tensor]], density: float) -> dict[str, float]:
    """Each tensor's share (≥ 1) of the next step's density, from ``key: (numel, sample)`` taken at
    ``density``: the fraction of its sample at or above the magnitude that density·(all numel)
    entries of the whole model reach, over ``density``. Fewer than two tensors, nothing to keep,
    all-zero or non-finite samples: every share 1."""
    shares = {key: 1.0 for key in sampled}
    kept = density * sum(numel for numel, _ in sampled.values())
    if len(sampled) < 2 or not kept > 0 or not all(bool(sample.isfinite().all()) for _, sample in sampled.values()):
        return shares
    tiny = torch.finfo(torch.float32).tiny  # zeros land in a bin far below every magnitude
    octaves = {key: sample.clamp(min=tiny).log2().mul_(BINS_PER_OCTAVE).floor_().long()
               for key, (_, sample) in sampled.items() if sample.numel()}
    if len(octaves) < 2 or not max(float(sample.max()) for _, sample in sampled.values() if sample.numel()) > 0:
        return shares
    top = max(int(o.max()) for o in octaves.values())
    bins = {key: top - o for key, o in octaves.items()}  # 0: the largest magnitudes
    length = max(int(b.max()) for b in bins.values()) + 1
    reach = torch.stack([torch.bincount(b, minlength=length).to(torch.float64) * (sampled[key][0] / b.numel())
                         for key, b in bins.items()]).sum(0)
    reach = cumulative(reach)  # the model's entries at or above each bin
    last = min(int(torch.searchsorted(reach, torch.tensor(kept, dtype=torch.float64, device=reach.device))),
               length - 1)
    before = float(reach[last - 1]) if last > 0 else 0.0
    within = min(1.0, (kept - before) / max(float(reach[last]) - before, 1e-300))  # of the threshold's bin
    for key, b in bins.items():
        above = float((b < last).sum()) + within * float((b == last).sum())
        shares[key] = max(1.0, above / b.numel() / density)
    return shares
