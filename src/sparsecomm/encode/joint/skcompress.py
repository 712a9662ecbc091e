"""``skcompress``: SketchML / SKCompress — keys and values of a sparse gradient in one section.

    skcompress(bins=256, groups=8, rows=2, columns=0.3, coder=huffman|ans, keys=bytes|rice)

1. Quantile buckets: the splits are exact quantiles of the values at i/bins (the values are all
   here, and sorting r values costs less than the rest of the encoder, so a streaming sketch would
   only add error); equal quantiles merge, so fewer bins can result. Zero is added as a split when
   the values have both signs, so no bin straddles zero and a bin's midpoint keeps the sign.
2. Groups: the bins are cut into ``groups`` contiguous groups, aligned at zero (``zeroIdx``), so a
   group is all-negative or all-positive. A value becomes its bin's *rank* in its group: distance
   from the group's bin nearest zero.
3. One MinMaxSketch per group (`minmax_sketch`), ``rows`` × ceil(``columns`` × keys in the group):
   a decoded value is the midpoint of a bin at most as far from zero as its own — errors only
   shrink gradients.
4. Keys per group, sorted, as deltas in 1/2/4/8 bytes with a 2-bit prefix (SketchML), or with
   ``keys=rice`` (ours) as Golomb-Rice gaps, which spends about log2(e·gap) bits instead of whole bytes.
5. Sketch cells and key prefixes entropy-coded (`sparsecomm.encode.entropy`): Huffman as in
   SKCompress, or rANS (``coder=ans``).

Layout: hash seed (u64), split count (u16), splits (f32), group count (u8), per group first bin,
end bin (u16 each) and key count (u32), the cells block, then the keys: the prefixes block and the
delta bytes, or one Rice stream of the gaps (delta - 1).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.encode.base import INDEX_CODECS, IndexCodec
from sparsecomm.encode.entropy import CODERS, decode_symbols, encode_symbols
from sparsecomm.encode.index.rice import decode_gaps, encode_gaps
from sparsecomm.encode.joint import minmax_sketch
from sparsecomm.errors import PayloadError, SparseCommError

_HEAD = struct.Struct("<QH")
_GROUP = np.dtype([("first_bin", "<u2"), ("end_bin", "<u2"), ("keys", "<u4")])
_DELTA_SIZES = np.array([1, 2, 4, 8])
MAX_BINS = (1 << 16) - 2
KEY_CODINGS = ("bytes", "rice")


def quantile_splits(values: np.ndarray, bins: int) -> np.ndarray:
    """Distinct exact quantiles at i/bins (float32), with 0 added between negative and positive
    values; at least two splits (one bin, possibly of zero width)."""
    ordered = np.sort(values.astype(np.float32))
    splits = np.unique(ordered[np.round(np.linspace(0, ordered.size - 1, bins + 1)).astype(np.int64)])
    if splits[0] < 0 < splits[-1] and not (splits == 0).any():
        splits = np.sort(np.append(splits, np.float32(0)))
    return splits if splits.size >= 2 else np.repeat(splits, 2)


def negative_bin_count(splits: np.ndarray) -> int:
    """``zeroIdx``: the bins below the first split ≥ 0."""
    return min(int(np.searchsorted(splits, 0.0, side="left")), splits.size - 1)


def group_bounds(bins: int, negative_bins: int, groups: int) -> np.ndarray:
    """Group edges over the bins [0, bins): ``groups`` contiguous groups (fewer if there are fewer
    bins), never straddling ``negative_bins`` (the zero edge)."""
    sides = [(0, negative_bins), (negative_bins, bins)]
    counts = [side_end - side_start for side_start, side_end in sides]
    if counts[0] and counts[1]:
        negative_groups = min(counts[0], max(1, round(groups * counts[0] / bins)), groups - 1)
        shares = [negative_groups, min(counts[1], groups - negative_groups)]
    else:
        shares = [min(counts[0], groups), min(counts[1], groups)]
    edges = [np.round(np.linspace(lo, hi, share + 1)).astype(np.int64)
             for (lo, hi), share in zip(sides, shares, strict=True) if share]
    return np.unique(np.concatenate(edges))


MAX_CELLS_PER_KEY = 8
"""bounds the sketch a decoder allocates per key it reads"""


@INDEX_CODECS.register("skcompress")
@dataclass(frozen=True)
class SKCompress(IndexCodec):
    bins: int = 256
    groups: int = 8
    rows: int = 2
    columns: float = 0.3
    coder: str = "huffman"
    keys: str = "bytes"
    codes_values = True
    values_lossless = False

    def __post_init__(self) -> None:
        if not 1 <= self.bins <= MAX_BINS:
            raise SparseCommError(f"skcompress bins must be in 1..{MAX_BINS}")
        if not 2 <= self.groups <= 255:
            raise SparseCommError("skcompress groups must be in 2..255 (groups are aligned at zero)")
        if not 1 <= self.rows <= 16:
            raise SparseCommError("skcompress rows must be in 1..16")
        if not 0.0 < self.columns <= 64.0:
            raise SparseCommError("skcompress columns (a factor of the keys per group) must be in (0, 64]")
        if self.rows * self.columns > MAX_CELLS_PER_KEY:
            raise SparseCommError(f"skcompress rows × columns must be at most {MAX_CELLS_PER_KEY} sketch cells per key "
                                  "(a sketch that large costs more than the values it replaces)")
        if self.coder not in CODERS:
            raise SparseCommError(f"skcompress coder must be one of {', '.join(CODERS)}")
        if self.keys not in KEY_CODINGS:
            raise SparseCommError(f"skcompress keys must be one of {', '.join(KEY_CODINGS)}")

    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        raise SparseCommError("skcompress codes indices and values together: use it through sparsecomm.encode")

    def decode(self, data: memoryview, numel: int, nnz: int) -> np.ndarray:
        raise PayloadError("skcompress codes indices and values together")

    def max_count(self, nbytes: int, numel: int) -> int:
        return nbytes if self.keys == "bytes" else 8 * nbytes  # a key takes at least a byte / a bit

    def encode_joint(self, indices: np.ndarray, values: torch.Tensor, numel: int, rng: np.random.Generator) -> bytes:
        seed = int(rng.integers(1 << 63))
        v = values.detach().to(torch.float32).cpu().numpy()
        splits = quantile_splits(v, self.bins) if v.size else np.zeros(2, dtype=np.float32)
        if not np.isfinite(splits).all():
            raise SparseCommError("skcompress: a value overflows float32")
        bins = splits.size - 1
        edges = group_bounds(bins, negative_bin_count(splits), self.groups)
        value_bin = np.clip(np.searchsorted(splits, v, side="right") - 1, 0, bins - 1)
        layout = _Layout(splits, edges)
        group = layout.group_of_bin[value_bin]
        order = np.argsort(group, kind="stable")  # keys stay ascending inside each group
        keys, group = indices[order], group[order]
        rank = np.abs(value_bin[order] - layout.nearest_zero[group])
        key_counts = np.bincount(group, minlength=layout.groups)
        columns = minmax_sketch.column_counts(key_counts, self.columns)
        cells_at = minmax_sketch.cell_positions(keys, group, columns, self.rows, seed)
        cells = minmax_sketch.build(rank, cells_at, np.repeat(layout.widths - 1, self.rows * columns))
        previous = np.concatenate([[-1], keys[:-1]])
        previous[_group_starts(key_counts)[key_counts > 0]] = -1
        deltas = (keys - previous).astype(np.uint64)
        head = [_HEAD.pack(seed, splits.size), splits.astype("<f4").tobytes(), bytes([layout.groups])]
        groups = np.empty(layout.groups, dtype=_GROUP)
        groups["first_bin"], groups["end_bin"], groups["keys"] = edges[:-1], edges[1:], key_counts
        head.append(groups.tobytes())
        cells_block = encode_symbols(cells, int(layout.widths.max()), self.coder)
        return b"".join([*head, cells_block, self._encode_deltas(deltas)])

    def _encode_deltas(self, deltas: np.ndarray) -> bytes:
        if self.keys == "rice":
            return encode_gaps(deltas.astype(np.int64) - 1)
        prefix = (deltas >= 1 << 8).astype(np.int64) + (deltas >= 1 << 16) + (deltas >= 1 << 32)
        delta_bytes = deltas.astype("<u8").view(np.uint8).reshape(-1, 8)
        body = delta_bytes[np.arange(8) < _DELTA_SIZES[prefix][:, None]]
        return encode_symbols(prefix, 4, self.coder) + body.tobytes()

    def _decode_deltas(self, data: memoryview, offset: int, count: int, numel: int) -> np.ndarray:
        if self.keys == "rice":
            return decode_gaps(data[offset:], count, numel) + 1
        prefix, offset = decode_symbols(data, offset, count, 4, self.coder)
        sizes = _DELTA_SIZES[prefix]
        body = np.frombuffer(data, dtype=np.uint8, offset=offset)
        if body.size != int(sizes.sum()):
            raise PayloadError(f"skcompress keys take {body.size} bytes, prefixes say {int(sizes.sum())}")
        delta_bytes = np.zeros((count, 8), dtype=np.uint8)
        delta_bytes[np.arange(8) < sizes[:, None]] = body
        return delta_bytes.view("<u8").reshape(count).astype(np.int64)

    def decode_joint(self, data: memoryview, numel: int, nnz: int,
                     dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        if len(data) < _HEAD.size:
            raise PayloadError("skcompress section is shorter than its header")
        seed, n_splits = _HEAD.unpack_from(data)
        offset = _HEAD.size + 4 * n_splits + 1
        if n_splits < 2 or len(data) < offset:
            raise PayloadError("skcompress splits are truncated")
        splits = np.frombuffer(data, dtype="<f4", count=n_splits, offset=_HEAD.size).astype(np.float32)
        if not np.isfinite(splits).all() or (splits[1:] < splits[:-1]).any():
            raise PayloadError("skcompress splits are not finite and ascending")
        n_groups = data[offset - 1]
        if len(data) < offset + n_groups * _GROUP.itemsize:
            raise PayloadError("skcompress groups are truncated")
        table = np.frombuffer(data, dtype=_GROUP, count=n_groups, offset=offset)
        groups = np.stack([table[field].astype(np.int64) for field in ("first_bin", "end_bin", "keys")], axis=1)
        offset += n_groups * _GROUP.itemsize
        edges = np.append(groups[:, 0], groups[-1, 1]) if n_groups else np.zeros(1, dtype=np.int64)
        if (n_groups == 0 or edges[0] != 0 or edges[-1] != n_splits - 1 or (groups[1:, 0] != groups[:-1, 1]).any()
                or (groups[:, 1] <= groups[:, 0]).any()):
            raise PayloadError("skcompress groups do not tile the bins")
        layout = _Layout(splits, edges)
        if layout.straddles_zero:
            raise PayloadError("skcompress group straddles zero")
        key_counts = groups[:, 2]
        if int(key_counts.sum()) != nnz:
            raise PayloadError(f"skcompress groups hold {int(key_counts.sum())} keys, header says {nnz}")
        columns = minmax_sketch.column_counts(key_counts, self.columns)
        group_of_cell = np.repeat(np.arange(n_groups), self.rows * columns)
        cells, offset = decode_symbols(data, offset, group_of_cell.size, int(layout.widths.max()), self.coder)
        if (cells >= layout.widths[group_of_cell]).any():
            raise PayloadError("skcompress sketch cell outside its group")
        deltas = self._decode_deltas(data, offset, nnz, numel)
        if nnz and (int(deltas.min()) < 1 or int(deltas.max()) > numel):
            raise PayloadError("skcompress key delta out of range")
        group = np.repeat(np.arange(n_groups), key_counts)
        running = np.cumsum(deltas)
        before_group = np.concatenate([[0], running])[_group_starts(key_counts)]
        keys = running - before_group[group] - 1
        if nnz and int(keys.max()) >= numel:
            raise PayloadError("skcompress key outside the tensor")
        rank = minmax_sketch.query(cells, minmax_sketch.cell_positions(keys, group, columns, self.rows, seed))
        value_bin = layout.nearest_zero[group] + layout.away_from_zero[group] * rank
        decoded = (splits[value_bin].astype(np.float64) + splits[value_bin + 1]) / 2
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        if nnz and not (keys[1:] > keys[:-1]).all():
            raise PayloadError("skcompress groups share a key")
        return keys, torch.from_numpy(decoded[order]).to(dtype)


class _Layout:
    """The groups over the bins: which group a bin is in, each group's bin nearest zero, and which
    way (+1 / -1) its bins move away from zero."""

    def __init__(self, splits: np.ndarray, edges: np.ndarray) -> None:
        negative_bins = negative_bin_count(splits)
        lo, hi = edges[:-1], edges[1:]
        self.groups = lo.size
        self.widths = hi - lo
        self.group_of_bin = np.repeat(np.arange(lo.size), self.widths)
        negative = hi <= negative_bins
        self.straddles_zero = bool(((lo < negative_bins) & (hi > negative_bins)).any())
        self.nearest_zero = np.where(negative, hi - 1, lo)
        self.away_from_zero = np.where(negative, -1, 1)


def _group_starts(key_counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(key_counts)[:-1]]).astype(np.int64)
