"""Runs of consecutive indices, sent as (start, length) pairs instead of one index each.

A tensor a pipeline sends whole (a bias under DGC's rule) puts every one of its indices in the
selection: as index codes, DGC's run lengths cost 2 bytes an entry, where DGC's own code sends such
a tensor by a dense all_reduce and no indices at all. A payload whose selection holds long runs
therefore lists them up front and leaves the index codec the rest, when that makes the index
section shorter (layout: `sparsecomm.payload`).

Runs block, at the head of the index section (little-endian)::

    4      run count R
    16*R   (start, length) of each run as two uint64, ascending, not touching, length >= 1

The index codec then codes the other indices as if the runs' positions were cut out of the tensor:
an index becomes its position among the tensor's ``numel - total`` positions outside the runs, so a
gap across a run costs what a gap of the same entries elsewhere would.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from sparsecomm.encode.base import IndexCodec
from sparsecomm.errors import PayloadError

MIN_RUN = 64
"""the shortest run worth a (start, length) pair: 16 bytes, at most two bits per index of it"""
_COUNT = struct.Struct("<I")
_PAIR_BYTES = 16


@dataclass(frozen=True)
class Runs:
    """Ascending, non-touching runs of indices: ``starts`` and ``lengths``, int64."""

    starts: np.ndarray
    lengths: np.ndarray

    @property
    def total(self) -> int:
        return int(self.lengths.sum())

    def _before(self) -> np.ndarray:
        """How many run indices lie before each run, and (last) in all."""
        return np.concatenate([[0], np.cumsum(self.lengths)])

    def cut(self, rest: np.ndarray) -> np.ndarray:
        """Indices outside the runs as positions among the positions outside them."""
        return rest - self._before()[np.searchsorted(self.starts, rest)]

    def merged(self, cut: np.ndarray) -> np.ndarray:
        """`cut`'s inverse applied to ``cut``, with the runs' own indices: every index, ascending.
        Expands the runs; call it once the payload's sections have decoded."""
        before = self._before()
        cut_starts = self.starts - before[:-1]  # each run's start with the runs before it cut out
        rest = cut + before[np.searchsorted(cut_starts, cut, side="right")]
        inside = np.arange(before[-1], dtype=np.int64) + np.repeat(cut_starts, self.lengths)
        return np.sort(np.concatenate([inside, rest]), kind="stable")

    def to_bytes(self) -> bytes:
        return _COUNT.pack(len(self.starts)) + np.stack([self.starts, self.lengths]).T.astype("<u8").tobytes()

    @classmethod
    def read(cls, data: memoryview, numel: int, nnz: int) -> tuple[Runs, memoryview]:
        """(the runs a block lists, the index codec's stream after it), checked against the
        tensor's ``numel`` and the payload's ``nnz``; nothing is expanded.

        Raises:
            PayloadError: a block that is cut short, runs out of order, touching, empty or outside
                the tensor, or more indices in runs than the payload holds."""
        if len(data) < _COUNT.size:
            raise PayloadError("the index section is too short for its runs block")
        (count,) = _COUNT.unpack_from(data)
        end = _COUNT.size + _PAIR_BYTES * count
        if count == 0 or end > len(data):
            raise PayloadError(f"runs block of {count} runs does not fit the {len(data)}-byte index section")
        pairs = np.frombuffer(data[_COUNT.size:end], dtype="<u8").reshape(count, 2)
        starts, lengths = pairs[:, 0], pairs[:, 1]
        # compared before any sum: each term stays at most numel (<= 2**48), so nothing overflows
        if (lengths == 0).any() or (starts >= numel).any() or (lengths > numel - starts).any():
            raise PayloadError("a run is empty or reaches outside the tensor")
        runs = cls(starts.astype(np.int64), lengths.astype(np.int64))
        if (runs.starts[1:] <= runs.starts[:-1] + runs.lengths[:-1]).any():
            raise PayloadError("runs are out of order or touch")
        if runs.total > nnz:
            raise PayloadError(f"runs hold {runs.total} indices, the payload {nnz}")
        return runs, data[end:]


def with_runs(codec: IndexCodec, indices: np.ndarray, numel: int, plain: bytes) -> bytes | None:
    """The index section with ``indices``' runs of at least `MIN_RUN` listed first and ``codec``
    coding the rest, or None where there are none or it is not shorter than ``plain`` (``codec``'s
    coding of them all). ``indices``: int64, strictly increasing; ``codec`` lossless."""
    if indices.size < MIN_RUN:
        return None
    first = np.flatnonzero(np.diff(indices, prepend=indices[0] - 2) != 1)  # each run's first position
    lengths = np.diff(first, append=indices.size)
    long = lengths >= MIN_RUN
    if not long.any():
        return None
    starts, lengths = first[long], lengths[long]
    edges = np.zeros(indices.size + 1, dtype=np.int64)
    edges[starts] += 1
    edges[starts + lengths] -= 1
    runs = Runs(indices[starts], lengths)
    rest = indices[np.cumsum(edges[:-1]) == 0]
    section = runs.to_bytes() + codec.encode(runs.cut(rest), numel - runs.total)
    return section if len(section) < len(plain) else None
