"""What one transport call takes and gives back: a frozen `Request` in, a `Reduction` (the sum and
a `CallRecord`) out. Nothing about a call travels in mutable objects shared with the caller."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsecomm.encode.base import IndexCodec, ValueCodec


@dataclass(frozen=True)
class Agreement:
    """What the agreement step established, the same on every rank: the largest nnz of any rank
    and, when every rank sent one, every rank's payload size (in rank order)."""

    max_nnz: int
    sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Request:
    """One transport call's inputs besides the tensor.

    ``key`` names the stream (a tensor or a DDP bucket) and ``call`` counts that stream's calls:
    the agreement step checks every rank passes the same pair, so ranks can never sum different
    tensors. The codecs are the pipeline's (``allgather`` encodes with them); ``seed`` and ``step``
    seed stochastic parts (with the rank); ``payload`` is this rank's payload when the pipeline has
    already encoded it; ``nonfinite`` makes every rank raise at the agreement step; ``agreement`` is
    set by a caller (``auto``) that already ran that step."""

    key: str = ""
    call: int = 0
    seed: int = 0
    step: int = 0
    index_codec: IndexCodec | None = None
    value_codec: ValueCodec | None = None
    payload: bytes | torch.Tensor | None = None
    nonfinite: bool = False
    agreement: Agreement | None = None

    @property
    def key_hash(self) -> int:
        return zlib.crc32(self.key.encode()) & 0x7FFFFFFF

    def rng(self, rank: int) -> np.random.Generator:
        """A generator for this call on ``rank``: the same on every run, different per rank and step."""
        return np.random.default_rng([self.seed, self.key_hash, self.step, rank])


@dataclass
class CallRecord:
    """What one call did: the transport that ran, bytes this rank sent, seconds spent decoding,
    and (for ``auto``) the model's predictions in milliseconds."""

    transport: str = ""
    bytes_sent: int = 0
    decode_s: float = 0.0
    predicted_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Reduction:
    """A transport call's result: the dense sum over ranks, and the call's record."""

    total: torch.Tensor
    record: CallRecord
