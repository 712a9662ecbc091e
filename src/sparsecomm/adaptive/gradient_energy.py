"""How much of a gradient's energy (sum of squares) its largest entries hold: the curve the adaptive
controller picks its density from (`Costs.energy_density`).

Sending the k largest entries of a gradient g decreases the loss, to first order, in proportion to
the energy they hold, E(k) = sum of their squares; a step that sends them costs T0 + c·k seconds.
The density worth sending is the one with the most energy per second of step, E(k) / (T0 + c·k).

The curve is read from a strided sample of the gradient, binned by magnitude rather than sorted: a
histogram of eighth-octave bins (entries within one bin counted as equal) costs a fraction of a
sort, which on a small model's step would be a noticeable share of its time.
"""

from __future__ import annotations

import torch

BINS_PER_OCTAVE = 8
"""magnitude bins per factor of two of the squares: within one bin they differ by at most 9%"""


def energy_share(squares: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """The share of ``squares``' sum held by its largest ``fractions`` (of its length; each in
    [0, 1]), as float64 on ``fractions``' device. All-zero or non-finite squares: zeros."""
    fractions = fractions.to(torch.float64)
    squares = squares.to(torch.float64)
    total = squares.sum()
    if not bool(torch.isfinite(total) & (total > 0)):
        return torch.zeros_like(fractions)
    positive = squares[squares > 0]
    bins = positive.log2().mul_(BINS_PER_OCTAVE).floor_().long()
    bins = bins.max() - bins  # bin 0 holds the largest
    counts = torch.bincount(bins).to(torch.float64)
    energy = torch.bincount(bins, weights=positive)
    counted, held = counts.cumsum(0), energy.cumsum(0)
    taken = fractions.to(positive.device) * squares.numel()
    last = torch.searchsorted(counted, taken).clamp_(max=counts.numel() - 1)  # the bin the top `taken` end in
    within = ((taken - (counted[last] - counts[last])) / counts[last].clamp(min=1)).clamp_(0.0, 1.0)
    share = (held[last] - energy[last] + within * energy[last]) / total
    return share.to(fractions.device)
