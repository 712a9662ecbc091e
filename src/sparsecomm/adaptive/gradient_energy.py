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

import math

import torch

from sparsecomm.device.cumulative import cumulative

BINS_PER_OCTAVE = 8
"""magnitude bins per factor of two of the squares: within one bin they differ by at most 9%"""
OCTAVES = 64
"""octaves of the squares below the largest that get bins of their own: entries smaller still (by
2^32 in magnitude) share the last bin, and hold next to nothing"""


def energy_share(squares: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """The share of ``squares``' sum held by its largest ``fractions`` (of its length; each in
    [0, 1]), as float64 on ``squares``' device: fixed-size tensor ops, no host read. All-zero or
    non-finite squares: zeros."""
    squares = squares.to(torch.float64)
    fractions = fractions.to(squares.device, torch.float64)
    total = squares.sum()
    positive = torch.isfinite(squares) & (squares > 0)
    squares = torch.where(positive, squares, 0.0)
    octave = squares.clamp(min=torch.finfo(torch.float64).tiny).log2_().mul_(BINS_PER_OCTAVE).floor_()
    top = torch.where(positive, octave, -math.inf).max()
    size = OCTAVES * BINS_PER_OCTAVE
    bins = torch.where(positive, (top - octave).clamp_(0, size - 1), size - 1).long()  # bin 0 holds the largest
    counts = squares.new_zeros(size).scatter_add_(0, bins, positive.to(torch.float64))
    energy = squares.new_zeros(size).scatter_add_(0, bins, squares)
    counted, held = cumulative(counts), cumulative(energy)
    taken = fractions * squares.numel()
    last = torch.searchsorted(counted, taken).clamp_(max=size - 1)  # the bin the top `taken` end in
    within = ((taken - (counted[last] - counts[last])) / counts[last].clamp(min=1)).clamp_(0.0, 1.0)
    share = (held[last] - energy[last] + within * energy[last]) / total
    return torch.where(torch.isfinite(total) & (total > 0), share, 0.0)
