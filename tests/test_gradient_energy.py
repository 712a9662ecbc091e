"""The energy curve the adaptive budget picks its density from: the share of a gradient's sum of
squares that its largest entries hold, read from a magnitude histogram instead of a sort."""

from __future__ import annotations

import math

import pytest
import torch

from sparsecomm.adaptive.gradient_energy import energy_share
from sparsecomm.bench.op_counts import count_ops

FRACTIONS = torch.tensor([0.0, 0.001, 0.01, 0.05, 0.2, 0.5, 1.0])


def sorted_share(squares: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """The exact share, by sorting (what the histogram stands in for)."""
    ordered = squares.to(torch.float64).sort(descending=True).values
    held = torch.cat([ordered.new_zeros(1), ordered.cumsum(0)]) / ordered.sum()
    return torch.stack([held[round(float(f) * squares.numel())] for f in fractions])


@pytest.mark.parametrize("seed", range(3))
def test_the_share_follows_the_sorted_curve_of_a_heavy_tailed_gradient(seed):
    generator = torch.Generator().manual_seed(seed)
    gradient = torch.randn(20_000, generator=generator) * torch.rand(20_000, generator=generator).pow(6)
    squares = gradient.square()
    shares = energy_share(squares, FRACTIONS)
    assert shares.dtype == torch.float64
    assert torch.allclose(shares, sorted_share(squares, FRACTIONS), atol=0.03)  # within a quarter-octave bin
    assert shares[0] == 0 and shares[-1] == pytest.approx(1.0)
    assert bool((shares.diff() >= 0).all())


def test_equal_entries_share_in_proportion_and_zeros_hold_nothing():
    assert torch.allclose(energy_share(torch.full((1000,), 2.5), FRACTIONS), FRACTIONS.double())
    squares = torch.tensor([4.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    shares = energy_share(squares, torch.tensor([0.125, 0.25, 0.5]))
    assert shares.tolist() == pytest.approx([0.8, 1.0, 1.0])  # the largest eighth is the 4


def test_a_gradient_with_no_energy_or_a_non_finite_one_has_no_curve():
    assert energy_share(torch.zeros(100), FRACTIONS).tolist() == [0.0] * len(FRACTIONS)
    assert energy_share(torch.tensor([1.0, math.inf, 2.0]), FRACTIONS).tolist() == [0.0] * len(FRACTIONS)
    assert energy_share(torch.tensor([1.0, math.nan, 2.0]), FRACTIONS).tolist() == [0.0] * len(FRACTIONS)


def test_the_curve_is_read_without_a_host_read_and_entries_far_below_the_largest_hold_nothing():
    squares = torch.cat([torch.tensor([1.0]), torch.full((99,), 1e-30)])  # 2^-99 below: the last bin
    counts = count_ops(lambda: energy_share(squares, FRACTIONS), 1)
    assert counts.syncs == 0
    assert energy_share(squares, torch.tensor([0.01, 0.5])).tolist() == pytest.approx([1.0, 1.0])
