"""`all_finite` agrees with torch.isfinite on every value it can be given; `largest_magnitude` is
the inf norm, NaN included."""

import math

import pytest
import torch

from sparsecomm.finite import all_finite, largest_magnitude


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_is_judged_as_torch_judges_it(dtype):
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(every)
    assert 0 < int(finite.sum()) < every.numel()
    for value, expected in zip(every.split(1), finite.tolist(), strict=True):
        if not expected:  # each non-finite pattern alone, and among finite ones
            assert not all_finite(value)
            assert not all_finite(torch.cat([every[finite][:100], value, every[finite][-100:]]))
    assert all_finite(every[finite])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_entry_anywhere_is_found_also_in_strided_views(dtype, bad):
    values = torch.randn(4097, dtype=torch.float64).to(dtype)
    assert all_finite(values) and all_finite(values[::3])
    for where in (0, 2048, 4095):
        spoiled = values.clone()
        spoiled[where] = bad
        assert not all_finite(spoiled)
        assert all_finite(spoiled[::3]) == (where % 3 != 0)
        assert all_finite(spoiled[1::2]) == (where % 2 == 0)


def test_empty_and_integer_tensors_are_finite():
    assert all_finite(torch.empty(0))
    assert all_finite(torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_values_whose_sum_overflows_are_finite(dtype):
    largest = torch.finfo(dtype).max
    assert all_finite(torch.full((1000,), largest, dtype=dtype))
    assert all_finite(torch.tensor([largest, largest, -largest], dtype=dtype))
    assert not all_finite(torch.tensor([largest, largest, float("nan")], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opposite_infinities_are_not_finite(dtype):
    assert not all_finite(torch.tensor([float("inf"), 1.0, float("-inf")], dtype=dtype))
    assert not all_finite(torch.randn(100_000, dtype=dtype).index_fill_(0, torch.tensor([7, 99_000]), float("inf")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_largest_magnitude_is_that_of_the_most_negative_or_positive_entry_and_nan_stays(dtype):
    assert float(largest_magnitude(torch.tensor([-7.0, 3.0, 5.0], dtype=dtype))) == 7.0
    assert float(largest_magnitude(torch.tensor([-2.0, 6.0], dtype=dtype))) == 6.0
    assert largest_magnitude(torch.tensor([1.0, 2.0], dtype=dtype)).dtype == dtype
    assert math.isnan(float(largest_magnitude(torch.tensor([1.0, math.nan, -3.0], dtype=dtype))))
    assert math.isinf(float(largest_magnitude(torch.tensor([1.0, -math.inf], dtype=dtype))))
