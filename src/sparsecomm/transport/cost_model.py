"""The α-β cost model of SparCML §5, per transport, plus the compute each algorithm really does.

A message of L bytes costs α + βL. Each algorithm's time is its messages times α plus its wire
bytes times β (the formulas of §5.3, with the expected result size under uniform indices
E[K] = N(1 − (1 − k/N)^P), App. B), plus its compute: memory passes over buffers it allocates and
fills, sort-based merges of sparse streams, encode/decode, hashing — each at a rate measured by
``sparsecomm calibrate`` (a JSON file named by $SPARSECOMM_COST_MODEL, else
~/.cache/sparsecomm/cost_model.json; built-in defaults measured on the 2-core development machine
otherwise). The floor measurements are compared with is the benchmark's
(`sparsecomm.bench.collectives_bench.floor`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from sparsecomm.errors import SparseCommError
from sparsecomm.transport.owner_counts import owner_counts_bytes

DEFAULT_PATH = Path.home() / ".cache" / "sparsecomm" / "cost_model.json"
INDEX_BYTES = 4
ENTRY_BYTES = 12  # an int64 index and a float32 value, as streams are summed in memory
DENSE_PATH_FRACTION = 1 / 20  # as in streams.sum_streams


@dataclass(frozen=True)
class CostModel:
    alpha: float = 90e-6
    """seconds per message"""
    beta: float = 1 / 3.0e9
    """seconds per byte on the wire"""
    codec_per_nnz: float = 60e-9
    """seconds to encode + decode one nonzero with rice + fp32"""
    pass_per_byte: float = 0.6e-9
    """seconds per byte of one pass over a freshly allocated buffer (allocate, fill, copy, add)"""
    sort_per_entry: float = 60e-9
    """seconds per entry to merge sparse streams by sorting"""
    hash_per_entry: float = 40e-9
    """seconds per index per sketch row to compute bucket and sign hashes"""
    quantize_per_value: float = 7.5e-9
    """seconds to QSGD-quantize and pack one value of a dense range (4 bits)"""
    dequantize_per_value: float = 3e-9
    """seconds to unpack and dequantize one QSGD value"""
    source: str = "default"

    def fingerprint(self) -> int:
        from sparsecomm.transport.collectives import fingerprint

        return fingerprint(self.alpha, self.beta, self.codec_per_nnz, self.pass_per_byte, self.sort_per_entry,
                           self.hash_per_entry, self.quantize_per_value, self.dequantize_per_value)

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def expected_union(numel: float, nnz: float, parts: float) -> float:
        if numel <= 0:
            return 0.0
        return numel * (1.0 - (1.0 - min(nnz, numel) / numel) ** parts)

    @staticmethod
    def _stream_bytes(length: float, nnz: float, isize: int) -> float:
        return min(nnz * (INDEX_BYTES + isize), length * isize)

    def _passes(self, nbytes: float, count: float = 1.0) -> float:
        return count * nbytes * self.pass_per_byte

    def _sum(self, entries: float, length: float, isize: int) -> float:
        """Summing streams holding ``entries`` in total over a range of ``length``."""
        if entries >= DENSE_PATH_FRACTION * length:
            return self._passes(length * isize, 3) + self._passes(entries * ENTRY_BYTES)
        return entries * self.sort_per_entry

    def _agree(self, workers: int) -> float:
        return 2 * math.ceil(math.log2(workers)) * self.alpha if workers > 1 else 0.0

    # -- per transport ------------------------------------------------------------------------
    def dense(self, workers: int, numel: int, isize: int = 4) -> float:
        if workers == 1:
            return self._passes(numel * isize)
        nbytes = numel * isize
        return (self._agree(workers) + 2 * (workers - 1) * self.alpha + 2 * (workers - 1) / workers * nbytes * self.beta
                + self._passes(nbytes, 1 + 2 * (workers - 1) / workers))

    def allgather(self, workers: int, numel: int, nnz: int, payload_bytes_per_nnz: float) -> float:
        payload = nnz * payload_bytes_per_nnz
        compute = ((workers + 1) / 2 * nnz * self.codec_per_nnz + self._passes(numel * 4)
                   + self._passes(workers * nnz * ENTRY_BYTES) + self._passes(workers * payload, 2))
        if workers == 1:
            return compute
        # the size exchange rides on the agreement step, then one gather of the payloads
        return (self._agree(workers) + (workers - 1) * self.alpha + (workers - 1) * payload * self.beta
                + compute)

    def ssar_rd(self, workers: int, numel: int, nnz: int, isize: int = 4) -> float:
        base = 1 << (workers.bit_length() - 1)
        total = self._agree(workers) + self._passes(numel * isize, 2)  # final densify
        if workers > base:  # fold in and copy back
            folded = self.expected_union(numel, nnz, 2)
            final = self._stream_bytes(numel, self.expected_union(numel, nnz, workers), isize)
            total += (4 * self.alpha + (self._stream_bytes(numel, nnz, isize) + final) * self.beta
                      + self._sum(2 * nnz, numel, isize) + self._passes(final, 4))
            nnz = round(folded)
        distance = 1
        while distance < base:
            entries = self.expected_union(numel, nnz, distance)
            nbytes = self._stream_bytes(numel, entries, isize)
            total += (2 * self.alpha + nbytes * self.beta + self._passes(nbytes, 4)
                      + self._sum(2 * entries, numel, isize))
            distance <<= 1
        return total

    def split_allgather(self, workers: int, numel: int, nnz: int, isize: int = 4, dense_phase: bool = False,
                        qsgd_bits: int = 0, keep: bool = False) -> float:
        """SparCML's split-allgather; ``keep``: its owners send on only ⌈nnz/P⌉ entries each (``topk_sa``)."""
        range_len = numel / workers
        own = self._stream_bytes(numel, nnz, isize)
        union = self.expected_union(numel, nnz, workers) / workers
        if keep:
            union = min(union, nnz / workers)
        if dense_phase:
            item = qsgd_bits / 8 + 4 / 1024 if qsgd_bits else isize
            reduced = range_len * item
        else:
            reduced = self._stream_bytes(range_len, union, isize)
        compute = (self._passes(own, 3) + self._sum(nnz, range_len, isize) + self._passes(reduced, 2)
                   + self._passes(workers * reduced, 3) + self._passes(numel * isize, 2))
        if dense_phase and qsgd_bits:  # the owner quantizes its range; every rank dequantizes all N
            compute += range_len * self.quantize_per_value + numel * self.dequantize_per_value
        if workers == 1:
            return compute
        counts = owner_counts_bytes(workers) if keep else 0  # topk_sa's owners' counts before their cut
        return (self._agree(workers) + 4 * (workers - 1) * self.alpha
                + ((workers - 1) / workers * own + (workers - 1) * reduced + counts) * self.beta + compute)

    def sketch(self, workers: int, numel: int, nnz: int, ratio: float, block: int, rows: int = 1,
               decode: str = "median") -> float:
        """λ cells per entry of the largest rank's (``median``), or per entry of the blocks every rank
        marked, summed over ranks (``peel``: its sketch and its decoding grow with the ranks)."""
        if decode == "peel":
            blocks = -(-numel // block)
            marked = min(numel, block * self.expected_union(blocks, 1, nnz)) if nnz else 0
            unknowns = workers * marked
        else:
            unknowns = nnz
        nbytes = 4 * ratio * unknowns + numel / (8 * block)
        union = unknowns if decode == "peel" else self.expected_union(numel, nnz, workers)
        compute = ((nnz + union) * rows * 2 * self.hash_per_entry + self._passes(numel, 3)
                   + self._passes(numel * 4, 2) + self._passes(nbytes, 2 * (workers - 1) / workers))
        return (self._agree(workers) + 4 * (workers - 1) * self.alpha + 2 * (workers - 1) / workers * nbytes * self.beta
                + compute)

    # -- choices ------------------------------------------------------------------------------
    def sparse_algorithms(self, workers: int, numel: int, nnz: int, isize: int = 4,
                          qsgd_bits: int = 0) -> dict[str, float]:
        return {
            "ssar_rd": self.ssar_rd(workers, numel, nnz, isize),
            "ssar_sa": self.split_allgather(workers, numel, nnz, isize),
            "dsar_sa": self.split_allgather(workers, numel, nnz, isize, dense_phase=True, qsgd_bits=qsgd_bits),
        }

    def best_sparse_algorithm(self, workers: int, numel: int, nnz: int, isize: int = 4, qsgd_bits: int = 0) -> str:
        costs = self.sparse_algorithms(workers, numel, nnz, isize, qsgd_bits)
        return min(costs, key=costs.__getitem__)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def load_cost_model(path: str | Path | None = None) -> CostModel:
    """The calibrated model from ``path``, $SPARSECOMM_COST_MODEL or the default cache file; else
    the built-in defaults. (To use a model of your own, pass it to a `TransportSession`.)"""
    chosen = Path(path) if path else Path(os.environ.get("SPARSECOMM_COST_MODEL", DEFAULT_PATH))
    if not chosen.is_file():
        return CostModel()
    try:
        fields = json.loads(chosen.read_text())
        return CostModel(**{**fields, "source": str(chosen)})
    except (ValueError, TypeError) as err:
        raise SparseCommError(f"cost model file {chosen} is unreadable: {err}") from None
