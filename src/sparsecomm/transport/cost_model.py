"""The α-β cost model of SparCML §5, per transport, with measured compute rates.

A message of L bytes costs α + βL. Each algorithm's time is its message count times α plus its
bytes times β (the formulas of §5.3 with the expected result size under uniform indices,
E[K] = N(1 − (1 − k/N)^P), App. B), plus encode/decode/sum time at measured rates. α, β and the
rates come from ``sparsecomm calibrate`` (a JSON file named by $SPARSECOMM_COST_MODEL, else
~/.cache/sparsecomm/cost_model.json); without one, defaults measured on loopback here are used.
`lower_bound` is the bound every measurement is compared with: ⌈log2 P⌉ messages, and each rank
receiving at least the (P−1)/P of the result it does not own, in its smaller representation.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from sparsecomm.errors import SparseCommError

DEFAULT_PATH = Path.home() / ".cache" / "sparsecomm" / "cost_model.json"
INDEX_BYTES = 4


@dataclass(frozen=True)
class CostModel:
    alpha: float = 60e-6
    """seconds per message"""
    beta: float = 1 / 1.5e9
    """seconds per byte on the wire"""
    codec_per_nnz: float = 60e-9
    """seconds to encode + decode one nonzero with the pipeline's codecs"""
    reduce_per_byte: float = 0.4e-9
    """seconds per byte to sum, densify or copy streams"""
    source: str = "default"

    def fingerprint(self) -> int:
        from sparsecomm.transport.collectives import fingerprint

        return fingerprint(self.alpha, self.beta, self.codec_per_nnz, self.reduce_per_byte)

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def expected_union(numel: int, nnz: int, parts: int) -> float:
        if numel == 0:
            return 0.0
        return numel * (1.0 - (1.0 - min(nnz, numel) / numel) ** parts)

    def _stream_bytes(self, numel: float, nnz: float, isize: int) -> float:
        return min(nnz * (INDEX_BYTES + isize), numel * isize)

    def _output(self, numel: float, isize: int) -> float:
        """Every transport but dense ends by writing the dense result."""
        return numel * isize * self.reduce_per_byte

    def _agree(self, workers: int) -> float:
        return 2 * math.ceil(math.log2(workers)) * self.alpha if workers > 1 else 0.0

    # -- per transport ------------------------------------------------------------------------
    def dense(self, workers: int, numel: int, isize: int = 4) -> float:
        if workers == 1:
            return 0.0
        nbytes = numel * isize
        return (self._agree(workers) + 2 * (workers - 1) * self.alpha
                + 2 * (workers - 1) / workers * nbytes * (self.beta + self.reduce_per_byte))

    def allgather(self, workers: int, numel: int, nnz: int, payload_bytes_per_nnz: float) -> float:
        if workers == 1:
            return nnz * self.codec_per_nnz + self._output(numel, 4)
        payload = nnz * payload_bytes_per_nnz
        return (self._agree(workers) + 2 * (workers - 1) * self.alpha + (workers - 1) * payload * self.beta
                + workers * nnz * (self.codec_per_nnz + 8 * self.reduce_per_byte) + self._output(numel, 4))

    def ssar_rd(self, workers: int, numel: int, nnz: int, isize: int = 4) -> float:
        base = 1 << (workers.bit_length() - 1)
        total = self._agree(workers)
        if workers > base:  # fold in and copy back
            folded = self._stream_bytes(numel, self.expected_union(numel, nnz, workers), isize)
            first = self._stream_bytes(numel, nnz, isize)
            total += 4 * self.alpha + (first + folded) * (self.beta + self.reduce_per_byte)
        span = workers // base if workers > base else 1
        distance = 1
        while distance < base:
            nbytes = self._stream_bytes(numel, self.expected_union(numel, nnz, distance * span), isize)
            total += 2 * self.alpha + nbytes * (self.beta + 2 * self.reduce_per_byte)
            distance <<= 1
        return total + self._output(numel, isize)

    def split_allgather(self, workers: int, numel: int, nnz: int, isize: int = 4, dense_phase: bool = False,
                        qsgd_bits: int = 0) -> float:
        if workers == 1:
            return self._stream_bytes(numel, nnz, isize) * self.reduce_per_byte + self._output(numel, isize)
        phase1_bytes = (workers - 1) / workers * self._stream_bytes(numel, nnz, isize)
        range_len = numel / workers
        union = self.expected_union(numel, nnz, workers) / workers
        if dense_phase:
            item = qsgd_bits / 8 + 4 / 1024 if qsgd_bits else isize
            phase2_bytes = (workers - 1) * range_len * item
        else:
            phase2_bytes = (workers - 1) * min(union * (INDEX_BYTES + isize), range_len * isize)
        return (self._agree(workers) + 4 * (workers - 1) * self.alpha + (phase1_bytes + phase2_bytes) * self.beta
                + workers * self._stream_bytes(numel / workers, nnz / workers, isize) * self.reduce_per_byte
                + self._output(numel, isize))

    def sketch(self, workers: int, numel: int, nnz: int, ratio: float, block: int) -> float:
        nbytes = 4 * ratio * nnz + numel / (8 * block)
        return (self._agree(workers) + 4 * (workers - 1) * self.alpha
                + 2 * (workers - 1) / workers * nbytes * (self.beta + self.reduce_per_byte) + self._output(numel, 4))

    def lower_bound(self, workers: int, numel: int, nnz: int, isize: int = 4) -> float:
        if workers == 1:
            return 0.0
        result = self._stream_bytes(numel, self.expected_union(numel, nnz, workers), isize)
        return math.ceil(math.log2(workers)) * self.alpha + (workers - 1) / workers * result * self.beta

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


_OVERRIDE: CostModel | None = None


def set_cost_model(model: CostModel | None) -> None:
    """Use ``model`` in this process from now on (None: back to files and defaults)."""
    global _OVERRIDE
    _OVERRIDE = model


def load_cost_model(path: str | Path | None = None) -> CostModel:
    """The model set by `set_cost_model`, else the calibrated model from ``path``,
    $SPARSECOMM_COST_MODEL or the default cache file; else the built-in defaults."""
    if _OVERRIDE is not None and path is None:
        return _OVERRIDE
    chosen = Path(path) if path else Path(os.environ.get("SPARSECOMM_COST_MODEL", DEFAULT_PATH))
    if not chosen.is_file():
        return CostModel()
    try:
        fields = json.loads(chosen.read_text())
        return CostModel(**{**fields, "source": str(chosen)})
    except (ValueError, TypeError) as err:
        raise SparseCommError(f"cost model file {chosen} is unreadable: {err}") from None
