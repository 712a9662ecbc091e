"""Information bounds for sparse index sets."""

from __future__ import annotations

import math


def subset_bits(numel: int, nnz: int) -> float:
    """log2 C(numel, nnz): the fewest bits that can name an nnz-subset of numel positions."""
    if nnz == 0 or nnz == numel:
        return 0.0
    return (math.lgamma(numel + 1) - math.lgamma(nnz + 1) - math.lgamma(numel - nnz + 1)) / math.log(2)


def subset_bits_per_index(numel: int, nnz: int) -> float:
    return subset_bits(numel, nnz) / nnz if nnz else 0.0
