"""The transport interface: sum one tensor over the ranks of a process group.

``reduce(grad, group, request, out, session)`` takes this rank's contribution (a `SparseGradient`,
or a dense tensor) and returns a `Reduction`: the dense sum over all ranks, identical on every
rank — written into ``out`` when one is given (reusing a buffer spares a fresh allocation of the
whole tensor on every call; ``out`` may be the contribution's own tensor) — and the call's
`CallRecord`. ``allreduce`` returns the sum alone. ``reduce_async`` runs the call on the
session's worker thread and returns a ``torch.futures.Future``: calls of one session run in
submission order, so ranks that submit in the same order stay in step (do not use that group
from another thread at the same time). Without a session a call has nowhere to keep state: it
runs synchronously, and ``auto`` uses its model's choice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.host_memory import clear_
from sparsecomm.registry import Component, Registry
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.collectives import Group
from sparsecomm.transport.request import Reduction, Request
from sparsecomm.transport.session import TransportSession


class Transport(Component):
    """Sums a sparse or dense contribution over a process group."""

    exact: ClassVar[bool] = True
    carries_payloads: ClassVar[bool] = False
    """whether it sends the pipeline's encoded payloads (else it sends the selection its own way)"""

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        raise NotImplementedError

    def received_per_sent(self, world_size: int) -> float:
        """Bytes a rank receives and decodes per byte of selection it sends, at ``world_size`` ranks:
        what the ``adaptive`` planner prices each byte of a sparse step at. By default every other
        rank's contribution reaches every rank (an allgather): P − 1."""
        return float(max(1, world_size - 1))

    def prepare(self, group: Group, session: TransportSession) -> None:
        """Make, before the first call, what this transport's calls on ``group`` will need and the
        session keeps (every rank of ``group`` calls it, in the same order): a process group made
        inside a training step costs that step its rendezvous. Nothing by default."""

    def allreduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
                  out: torch.Tensor | None = None, session: TransportSession | None = None) -> torch.Tensor:
        """The sum over ranks alone (see `reduce`)."""
        return self.reduce(grad, group, request, out, session).total

    def reduce_async(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
                     out: torch.Tensor | None = None,
                     session: TransportSession | None = None) -> torch.futures.Future[Reduction]:
        """`reduce` on the session's worker thread (without a session: now, on this thread)."""
        future: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(self.reduce(grad, group, request, out, session))
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                future.set_exception(err)

        if session is None:
            run()
        else:
            session.submit(run)
        return future


def as_sparse(grad: SparseGradient | torch.Tensor) -> SparseGradient:
    return grad if isinstance(grad, SparseGradient) else SparseGradient.from_dense(grad)


def as_dense(grad: SparseGradient | torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if isinstance(grad, SparseGradient) else grad


def check_out(out: torch.Tensor | None, numel: int, dtype: torch.dtype | None) -> None:
    """Raise unless ``out`` (where given) can hold a sum of ``numel`` entries of ``dtype`` (None: of
    any, converted as it is written): checked before a call sends anything, so that a refusal
    reaches every rank (`output_buffer` checks again)."""
    if out is not None and (out.numel() != numel or dtype is not None and out.dtype != dtype):
        raise SparseCommError(f"out has {out.numel()} {out.dtype} elements; the sum needs {numel} {dtype}")


def refused_unless_out_fits(request: Request, out: torch.Tensor | None, numel: int,
                            dtype: torch.dtype | None) -> Request:
    """``request``, marked ``refused`` where ``out`` cannot hold the sum (`check_out`): the agreement
    step then raises on every rank, rather than this rank alone after the others have gone on."""
    try:
        check_out(out, numel, dtype)
    except SparseCommError as err:
        return replace(request, refused=str(err))
    return request


def output_buffer(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed flat buffer for a sum on ``device`` (the gradient's): ``out`` itself when it can be
    (checked), else new."""
    if out is not None:
        check_out(out, numel, dtype)
        if out.device == device and out.is_contiguous():
            flat = out.view(-1)
            clear_(flat)
            return flat
    return torch.zeros(numel, dtype=dtype, device=device)


def deliver(total: torch.Tensor, shape: torch.Size, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    """The sum in the caller's shape and device: ``out`` (filled) when given."""
    if out is None:
        return total.reshape(shape).to(device)
    if total.data_ptr() != out.data_ptr():
        out.copy_(total.reshape(out.shape))
    return out


TRANSPORTS: Registry[Transport] = Registry("transport")
"""every transport, by name"""
