"""Interfaces of index and value codecs.

Codecs are pure: ``encode`` turns data into bytes, ``decode`` turns those bytes (and the counts the
payload header carries) back. They never see anything else. Before ``decode`` runs, the payload
layer checks ``nnz <= max_count(len(data))``, so no header can make a codec allocate more than a
fixed multiple of the payload's size.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from sparsecomm.registry import Component


class IndexCodec(Component):
    """Codes a sorted set of unique flat indices into ``[0, numel)``. A lossy codec (``lossless``
    False) decodes to a set that may differ from the one encoded."""

    lossless: ClassVar[bool] = True

    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        """``indices``: int64, strictly increasing."""
        raise NotImplementedError

    def encode_selecting(self, indices: np.ndarray, numel: int,
                         rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
        """Encode, and say which indices the payload must carry values for, in the order ``decode``
        returns indices. Lossless codecs: ``indices`` themselves; a lossy one (``bloom``) may name
        others, whose values the payload layer takes from the dense gradient."""
        return self.encode(indices, numel), indices

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        """Back to int64 indices, strictly increasing (the payload layer verifies it)."""
        raise NotImplementedError

    def max_count(self, nbytes: int, numel: int) -> int:
        """The most indices ``nbytes`` of this codec's output can hold."""
        return 8 * nbytes


class ValueCodec(Component):
    """Codes the values of a sparse gradient, in index order."""

    lossless: ClassVar[bool] = True

    def encode(self, values: torch.Tensor, rng: np.random.Generator) -> bytes:
        """``values``: 1-D, on the CPU, finite. ``rng`` is the only randomness a codec may use."""
        raise NotImplementedError

    def decode(self, data: memoryview, nnz: int, dtype: torch.dtype) -> torch.Tensor:
        """Back to ``nnz`` values of ``dtype`` on the CPU."""
        raise NotImplementedError

    def max_count(self, nbytes: int) -> int:
        """The most values ``nbytes`` of this codec's output can hold."""
        return 8 * nbytes
