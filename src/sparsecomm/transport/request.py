"""What one transport call takes and gives back: a frozen `Request` in, a `Reduction` (the sum and
a `CallRecord`) out. Nothing about a call travels in mutable objects shared with the caller."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from sparsecomm.encode.base import IndexCodec, ValueCodec
from sparsecomm.sparse_gradient import SparseGradient


@dataclass(frozen=True)
class Agreement:
    """What the agreement step established, the same on every rank: the largest nnz of any rank,
    when every rank sent one, every rank's payload size (in rank order), and the ranks' nnz summed
    (0: a caller that did not count it)."""

    max_nnz: int
    sizes: tuple[int, ...] | None = None
    sides: torch.Tensor | None = field(default=None, compare=False)
    """every rank's side numbers (world size × `SIDE_FIELDS` float64, see `Request.side`)"""
    total_nnz: int = 0


@dataclass(frozen=True)
class Request:
    """One transport call's inputs besides the tensor.

    ``key`` names the stream (a tensor or a DDP bucket) and ``call`` counts that stream's calls:
    the agreement step checks every rank passes the same pair, so ranks can never sum different
    tensors. The codecs are the pipeline's (``allgather`` encodes with them); ``seed`` and ``step``
    seed stochastic parts (with the rank); ``payload`` is this rank's payload when the pipeline has
    already encoded it, and ``payload_is_contribution`` says the contribution passed with it is
    exactly what it decodes to (as a pipeline's selection is: values as receivers see them), so
    ``allgather`` need not decode it; ``nonfinite`` makes every rank raise at the agreement step,
    and so does ``refused`` (why this rank could not make its part: its codec refused its values, or another error);
    ``agreement`` is set by a caller (``auto``) that already ran that step; ``caller_config`` is a
    calling transport's configuration fingerprint (``auto``'s), which ``allgather`` checks with its
    own when it runs the agreement step for that caller; ``side``: a few numbers this rank shares
    with every rank on the agreement step (`sparsecomm.transport.side_numbers`), returned to every
    rank in the call's ``record.agreement.sides``; ``keeps_lost``: the caller's error feedback holds
    what an inexact transport loses (`Reduction.lost`), so ``auto`` may choose one."""

    key: str = ""
    call: int = 0
    seed: int = 0
    step: int = 0
    index_codec: IndexCodec | None = None
    value_codec: ValueCodec | None = None
    payload: bytes | torch.Tensor | None = None
    payload_is_contribution: bool = False
    nonfinite: bool = False
    refused: str = ""
    agreement: Agreement | None = None
    caller_config: int = 0
    side: tuple[float, ...] = ()
    keeps_lost: bool = False

    @property
    def key_hash(self) -> int:
        return zlib.crc32(self.key.encode()) & 0x7FFFFFFF

    def rng(self, rank: int) -> np.random.Generator:
        """A generator for this call on ``rank``: the same on every run, different per rank and step."""
        return np.random.default_rng([word % (1 << 64) for word in (self.seed, self.key_hash, self.step, rank)])


T = TypeVar("T")

PHASES = ("agreement", "encode", "transfer", "decode", "sum", "output")
"""the phases of a call, in the order they first run: the agreement step; encoding this rank's
contribution; waiting on transfers; decoding what arrived; summing it; clearing and delivering the
result"""


@dataclass
class CallRecord:
    """What one call did: the transport that ran, bytes this rank sent, seconds per phase on this
    rank (`PHASES`), the agreement it ran on (where it ran that step), and (for ``auto``) the
    model's predictions in milliseconds."""

    transport: str = ""
    bytes_sent: int = 0
    agreement: Agreement | None = None
    phases: dict[str, float] = field(default_factory=dict)
    predicted_ms: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def timed(self, items: Iterator[T], name: str) -> Iterator[T]:
        """``items``, with the time spent waiting for each added to phase ``name``."""
        while True:
            with self.phase(name):
                item = next(items, None)
            if item is None:
                return
            yield item

    @property
    def decode_s(self) -> float:
        """Seconds spent turning what arrived into the sum (decode and sum phases)."""
        return self.phases.get("decode", 0.0) + self.phases.get("sum", 0.0)


@dataclass(frozen=True)
class Reduction:
    """A transport call's result: the dense sum over ranks, and the call's record. A transport whose
    sum is not exact (a sketch, a quantized dense phase) says in ``lost`` what it lost of this
    rank's contribution (flat, sorted indices): summed over ranks, the exact sum minus ``total``,
    less what it judged not worth sending again (errors larger than what they carry, which error
    feedback would compound); the caller's feedback sends it again. None: nothing to send again."""

    total: torch.Tensor
    record: CallRecord
    lost: SparseGradient | None = None
