"""Interfaces of index and value codecs.

Codecs are pure: ``encode`` turns data into bytes, ``decode`` turns those bytes (and the counts the
payload header carries) back. They never see anything else. Before ``decode`` runs, the payload
layer checks ``nnz <= max_count(len(data))`` for the count it asks for (an index codec after a runs
block: the indices outside the runs, in a tensor with the runs cut out), and a codec's parameters,
read from the payload's text, are range-checked when it is built, so no header can make a codec
allocate more than the bound `sparsecomm.payload` documents.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from sparsecomm.registry import Component, Registry

MAX_STREAM_BYTES = 1 << 30
"""the most an index codec's stream may take: one whose size follows the gaps (a fixed Rice
parameter, run lengths) is refused beyond it, not grown with the tensor"""


class IndexCodec(Component):
    """Codes a sorted set of unique flat indices into ``[0, numel)``. A lossy codec (``lossless``
    False) decodes to a set that may differ from the one encoded. A joint codec (``codes_values``)
    codes the values too, in the same section; it implements `encode_joint` / `decode_joint`."""

    lossless: ClassVar[bool] = True
    scans_numel: ClassVar[bool] = False
    """whether decoding tests every index of the tensor (time grows with numel, not the payload)"""
    codes_values: ClassVar[bool] = False
    values_lossless: ClassVar[bool] = True
    """for a joint codec: whether its values decode exactly"""

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

    def encode_joint(self, indices: np.ndarray, values: torch.Tensor, numel: int, rng: np.random.Generator) -> bytes:
        """A joint codec: indices (strictly increasing) and their values in one section."""
        raise NotImplementedError

    def decode_joint(self, data: memoryview, numel: int, nnz: int,
                     dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """A joint codec: back to (strictly increasing indices, values of ``dtype``)."""
        raise NotImplementedError


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

    def largest(self) -> float:
        """The largest magnitude a value may have for this codec to carry it (beyond it, `encode`
        refuses): any finite one by default."""
        return math.inf

    def lossless_for(self, dtype: torch.dtype) -> bool:
        """Whether values of ``dtype`` decode to exactly what was encoded."""
        return self.lossless

    def as_decoded(self, values: torch.Tensor) -> torch.Tensor | None:
        """``values`` exactly as `decode` will give them back, where that is known without encoding
        and decoding (lossless and deterministic element-wise codecs); None otherwise. Lets error
        feedback learn what receivers see without decoding its own payload."""
        return values if self.lossless_for(values.dtype) else None


def codecs_lossless(index_codec: IndexCodec, value_codec: ValueCodec, dtype: torch.dtype | None = None) -> bool:
    """Whether a payload with these codecs decodes to exactly what was encoded (values of ``dtype``,
    when given: a cast to a narrower wire format is not exact)."""
    if index_codec.codes_values:
        values_exact = index_codec.values_lossless
    else:
        values_exact = value_codec.lossless if dtype is None else value_codec.lossless_for(dtype)
    return index_codec.lossless and values_exact


INDEX_CODECS: Registry[IndexCodec] = Registry("index")
"""every index codec (joint codecs too), by name"""
VALUE_CODECS: Registry[ValueCodec] = Registry("value")
"""every value codec, by name"""
