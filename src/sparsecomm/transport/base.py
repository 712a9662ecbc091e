"""The transport interface: sum one tensor over the ranks of a process group.

``allreduce`` takes this rank's contribution (a `SparseGradient`, or a dense tensor) and returns
the dense sum over all ranks, identical on every rank — written into ``out`` when one is given
(reusing a buffer spares a fresh allocation of the whole tensor on every call; ``out`` may be
the contribution's own tensor). ``allreduce_async`` does the same on a
worker thread and returns a ``torch.futures.Future`` (for DDP communication hooks). Calls on one
group are run in submission order, so ranks that submit in the same order stay in step; do not
use that group from another thread at the same time.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from sparsecomm.encode.base import IndexCodec, ValueCodec
from sparsecomm.errors import SparseCommError
from sparsecomm.registry import Component
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.collectives import Group, agree


@dataclass
class ReduceContext:
    """What a transport may use besides the tensor: the pipeline's codecs (``allgather`` encodes
    with them), the shared seed and step (stochastic parts derive their generators from them and
    the rank), and a place to count what was sent."""

    index_codec: IndexCodec | None = None
    value_codec: ValueCodec | None = None
    seed: int = 0
    step: int = 0
    payload: bytes | torch.Tensor | None = None
    """this rank's payload, when the pipeline already encoded it (``allgather`` then sends it as is)"""
    nonfinite: bool = False
    """this rank's input was non-finite: every rank raises at the agreement step"""
    agreed_nnz: int | None = None
    """set by a caller that already ran the agreement step (``auto``): the largest nnz over ranks"""
    agreed_sizes: list[int] | None = None
    """set with ``agreed_nnz`` when that step also carried every rank's ``payload`` size"""
    bytes_sent: int = 0
    chosen: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    def rng(self, rank: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, rank, self.step])


class Transport(Component):
    """Sums a sparse or dense contribution over a process group."""

    exact: ClassVar[bool] = True
    carries_payloads: ClassVar[bool] = False
    """whether it sends the pipeline's encoded payloads (else it sends the selection its own way)"""

    def allreduce(self, grad: SparseGradient | torch.Tensor, group: Group = None,
                  context: ReduceContext | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def allreduce_async(self, grad: SparseGradient | torch.Tensor, group: Group = None,
                        context: ReduceContext | None = None, out: torch.Tensor | None = None) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(self.allreduce(grad, group, context, out))
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                future.set_exception(err)

        _executor(group).submit(run)
        return future


def agreed(group: Group, context: ReduceContext | None, numel: int, config: int, nnz: int = 0) -> int:
    """The agreement step (`sparsecomm.transport.collectives.agree`), unless the caller already ran it."""
    if context is not None and context.agreed_nnz is not None:
        return context.agreed_nnz
    return agree(group, numel, config, nnz, nonfinite=bool(context and context.nonfinite))


def as_sparse(grad: SparseGradient | torch.Tensor) -> SparseGradient:
    return grad if isinstance(grad, SparseGradient) else SparseGradient.from_dense(grad)


def as_dense(grad: SparseGradient | torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if isinstance(grad, SparseGradient) else grad


def output_buffer(out: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed flat CPU buffer for a sum: ``out`` itself when it can be (checked), else new."""
    if out is not None:
        if out.numel() != numel or out.dtype != dtype:
            raise SparseCommError(f"out has {out.numel()} {out.dtype} elements; the sum needs {numel} {dtype}")
        if out.device.type == "cpu" and out.is_contiguous():
            flat = out.view(-1)
            flat.zero_()
            return flat
    return torch.zeros(numel, dtype=dtype)


def deliver(total: torch.Tensor, shape: torch.Size, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    """The sum in the caller's shape and device: ``out`` (filled) when given."""
    if out is None:
        return total.reshape(shape).to(device)
    if total.data_ptr() != out.data_ptr():
        out.copy_(total.reshape(out.shape))
    return out


_EXECUTORS: dict[int, ThreadPoolExecutor] = {}
_EXECUTORS_LOCK = threading.Lock()


def _executor(group: Group) -> ThreadPoolExecutor:
    """One worker thread per process group: its collectives run in submission order."""
    key = id(group)
    with _EXECUTORS_LOCK:
        if key not in _EXECUTORS:
            _EXECUTORS[key] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsecomm-transport")
        return _EXECUTORS[key]
