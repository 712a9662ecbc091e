"""Which of a Bloom filter's positives a receiver keeps (DeepReduce §4 and App. 10.4).

A filter holding ``r`` indices answers "yes" for a set P of ``|P| >= r`` indices: the true ones and
false positives. Every policy is a function of (P, the filter, r, a seeded generator), so the sender
and every receiver compute the same choice:

- ``naive``: the first r of P. The sender still sends the values of its true indices, in order,
  so after the first false positive every value lands on the wrong index (the paper's warning).
- ``leftmost``: the first r of P, with the values that belong to them.
- ``p0``: all of P; values for the false positives too, so nothing is lost.
- ``p1``: r of P drawn uniformly.
- ``p2``: conflict sets (Algorithm 1). The positives that hit filter bit j form set C_j; sets are
  visited smallest first (ties in random order) and each adds one random member not yet chosen,
  until r are chosen. A singleton holds a true positive, so true positives tend to be chosen first.
"""

from __future__ import annotations

import numpy as np

POLICIES = ("naive", "leftmost", "p0", "p1", "p2")


def choose(policy: str, positives: np.ndarray, positions: np.ndarray | None, count: int,
           rng: np.random.Generator) -> np.ndarray:
    """The ascending indices ``policy`` keeps out of ``positives`` (ascending). ``positions``
    (len(positives) × hashes filter bits) is needed by ``p2`` only."""
    if policy == "p0" or count >= positives.size:
        return positives
    if policy in ("naive", "leftmost"):
        return positives[:count]
    if policy == "p1":
        return np.sort(rng.choice(positives, size=count, replace=False))
    if policy == "p2":
        assert positions is not None
        return positives[conflict_set_choice(positions, count, rng)]
    raise ValueError(f"unknown bloom policy {policy!r}")


def conflict_set_choice(positions: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Algorithm 1 of DeepReduce, vectorised: returns ``count`` ascending row numbers of
    ``positions`` (one row per positive, one column per hash).

    Sets are visited by size class, smallest first. Within a class (visited in random order in
    the paper) every set proposes its highest-priority unchosen member at once; where several
    propose the same member the first set gets it and the others propose again in the next round.
    """
    items, hashes = positions.shape
    if items >= 1 << 31:
        raise ValueError("conflict sets support at most 2**31 positives")
    # (bit, item) pairs sorted by bit then item, as one int64 key (bits < 2**32, items < 2**31).
    pair_key = np.sort(((positions.astype(np.int64) << 31) | np.arange(items, dtype=np.int64)[:, None]), axis=None)
    pair_key = pair_key[np.r_[True, pair_key[1:] != pair_key[:-1]]]  # a bit two hashes share counts once
    bit, item = pair_key >> 31, pair_key & ((1 << 31) - 1)
    set_starts = np.r_[0, np.flatnonzero(np.diff(bit)) + 1]
    set_sizes = np.diff(np.r_[set_starts, bit.size])
    set_of_pair = np.repeat(np.arange(set_starts.size), set_sizes)
    # Relabel sets in visiting order: by size, ties broken at random; members by random priority.
    set_rank = np.empty(set_sizes.size, dtype=np.int64)
    set_rank[np.argsort((set_sizes << 31) | rng.integers(1 << 31, size=set_sizes.size))] = np.arange(set_sizes.size)
    order = np.argsort((set_rank[set_of_pair] << 31) | rng.integers(1 << 31, size=item.size))
    pair_set, pair_item = set_rank[set_of_pair][order], item[order]
    pair_size = set_sizes[set_of_pair][order]

    chosen = np.zeros(items, dtype=bool)
    consumed = np.zeros(set_sizes.size, dtype=bool)
    taken = 0
    class_bounds = np.flatnonzero(np.diff(pair_size)) + 1
    for lo, hi in zip(np.r_[0, class_bounds], np.r_[class_bounds, pair_size.size], strict=True):
        sets, members = pair_set[lo:hi], pair_item[lo:hi]
        while taken < count:
            open_pairs = np.flatnonzero(~chosen[members] & ~consumed[sets])
            if not open_pairs.size:
                break
            open_sets, open_members = sets[open_pairs], members[open_pairs]
            first_of_set = np.r_[True, open_sets[1:] != open_sets[:-1]]
            proposal_sets, proposals = open_sets[first_of_set], open_members[first_of_set]
            first_claim = _first_occurrences(proposals)
            first_claim = first_claim[: count - taken]
            chosen[proposals[first_claim]] = True
            consumed[proposal_sets[first_claim]] = True
            taken += first_claim.size
        if taken >= count:
            break
    if taken < count:  # every set visited: fill up at random from the rest
        rest = np.flatnonzero(~chosen)
        chosen[rng.choice(rest, size=count - taken, replace=False)] = True
    return np.flatnonzero(chosen)


def _first_occurrences(values: np.ndarray) -> np.ndarray:
    """Ascending positions of the first occurrence of each distinct value."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    return np.sort(order[np.r_[True, ordered[1:] != ordered[:-1]]])
