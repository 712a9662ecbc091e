"""SketchML's MinMaxSketch, for many independent sketches at once (one per key group).

A sketch has ``rows`` rows of ``columns`` cells; row j sends key k to column hash_j(k). Each cell
holds a *rank*: how far a bin lies from zero inside its group (0 = the bin nearest zero). Cells
start at the largest rank; inserting keeps the smaller rank (Min), querying takes the larger rank
over the rows (Max). Every cell a key touches holds a rank ≤ its own, so a queried rank never
exceeds the true one: collisions only pull values toward zero.
"""

from __future__ import annotations

import numpy as np

from sparsecomm.encode.hashing import bucket, mix64


def column_counts(key_counts: np.ndarray, factor: float) -> np.ndarray:
    """Columns per sketch: ``ceil(factor × keys)``, at least one for a non-empty group."""
    return np.where(key_counts > 0, np.maximum(1, np.ceil(factor * key_counts - 1e-9)), 0).astype(np.int64)


def cell_positions(keys: np.ndarray, group: np.ndarray, columns: np.ndarray, rows: int, seed: int) -> np.ndarray:
    """Flat cell index of every (key, row), shape (len(keys), rows); sketches laid out group after
    group, each row after row."""
    base = np.concatenate([[0], np.cumsum(rows * columns)[:-1]]) if columns.size else np.zeros(0, np.int64)
    width = columns[group]
    out = np.empty((keys.size, rows), dtype=np.int64)
    for row in range(rows):  # rows are few (default 2)
        column = bucket(mix64(keys, seed + 0x632BE5AB * (row + 1)), width).astype(np.int64)
        out[:, row] = base[group] + row * width + column
    return out


def build(ranks: np.ndarray, cells_at: np.ndarray, initial: np.ndarray) -> np.ndarray:
    """The cells after inserting every key's rank (Min) into cells ``cells_at`` (len(keys) × rows);
    ``initial`` is each cell's starting (largest) rank."""
    cells = initial.copy()
    np.minimum.at(cells, cells_at.reshape(-1), np.repeat(ranks, cells_at.shape[1]))
    return cells


def query(cells: np.ndarray, cells_at: np.ndarray) -> np.ndarray:
    """Each key's rank: the largest over its rows (Max)."""
    return cells[cells_at].max(axis=1) if cells_at.size else np.zeros(cells_at.shape[0], dtype=cells.dtype)
