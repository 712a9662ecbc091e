"""The feedback interface: turn this step's gradient into the tensor to sparsify, then learn what
was sent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from sparsecomm.host_memory import clear_
from sparsecomm.registry import Component, Registry
from sparsecomm.sparse_gradient import SparseGradient


class Feedback(Component):
    applies_momentum: ClassVar[bool] = False
    """whether this feedback applies SGD's momentum itself (the optimizer then must not)"""
    keeps_lost: ClassVar[bool] = False
    """whether `take_back` keeps what a transport lost, for a later step to send"""

    def accumulate(self, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The tensor to sparsify this step. Never modifies ``grad``."""
        raise NotImplementedError

    def update(self, accumulated: torch.Tensor, sent: SparseGradient, state: dict[str, Any]) -> None:
        """Record that ``sent`` (indices and the values the receivers will decode) left."""
        raise NotImplementedError

    def take_back(self, lost: SparseGradient, state: dict[str, Any]) -> None:
        """What the transport lost of what this rank sent (a sketch's collisions, a quantizer's
        rounding: `Reduction.lost`), added to what this feedback holds so that a later step sends
        it. Dropped by default: a feedback that holds nothing has nowhere to keep it."""

    def flush(self, grad: torch.Tensor, state: dict[str, Any], out: torch.Tensor, scale: float = 1.0) -> None:
        """A dense step of the ``adaptive`` pipeline: write this step's gradient with what the
        feedback sends along, times ``scale``, into ``out`` (flat; a narrower dtype such as fp16
        rounds it); `update_flushed` follows once the sum is in. By default everything kept from
        earlier steps goes along and the state keeps only what ``out`` lost, as `update` with every
        entry would. Never modifies ``grad``."""
        accumulated = self.accumulate(grad, state)
        flat = accumulated.reshape(-1)
        out.copy_(flat if scale == 1.0 else flat * scale)
        sent = out.to(flat.dtype) if scale == 1.0 else out.to(flat.dtype).div_(scale)
        self.update(accumulated, SparseGradient(torch.arange(flat.numel(), device=flat.device), sent,
                                                accumulated.shape), state)

    def flush_reads_only(self, grad: torch.Tensor, state: dict[str, Any], wire_dtype: torch.dtype,
                         scale: float = 1.0) -> bool:
        """Whether `flush` with these arguments only reads ``state``: then a dense step whose sum is
        never applied (a rank's NaN under ``nonfinite="raise"``) leaves nothing to undo, and the
        gradient need not be screened before it is sent (`sparsecomm.adaptive.flush.flush`). Not by default: the
        default flush moves what it held into the wire."""
        return False

    def flush_sends_gradient(self, numel: int, like: torch.Tensor, state: dict[str, Any]) -> bool:
        """Whether `flush` of a gradient of ``numel`` entries of ``like``'s dtype and device would
        write the gradient alone times its scale and change nothing (no rounding kept): then a
        bucket of such tensors flushes in one pass over the whole bucket. Not by default."""
        return False

    def delay_horizon(self) -> float:
        """Steps within which an entry this feedback holds back still moves the weights about as it
        would have on time (what the adaptive budget's density rule assumes): one, unless the
        feedback keeps a momentum."""
        return 1.0

    def update_flushed(self, averaged: torch.Tensor, state: dict[str, Any]) -> None:
        """After a dense step's all_reduce: what this feedback owns that follows the average (DGC's
        momentum, once it is the ranks' common buffer), applied to ``averaged`` in place. Every rank
        passes the same average. Nothing here: a flush sent everything."""

    def update_flushed_(self, averaged: list[torch.Tensor], states: list[dict[str, Any]]) -> None:
        """`update_flushed` for several tensors (one dense call's parameters): a feedback may do it
        in a few multi-tensor passes instead of a few per tensor (kernel launches on a GPU)."""
        for tensor, state in zip(averaged, states, strict=True):
            self.update_flushed(tensor, state)

    def update_uncompressed(self, averaged: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The update for a tensor the reducer sends without this pipeline (small tensors, sparse
        embedding rows), given its average over ranks: the average itself, unless this feedback
        owns something the optimizer lacks (DGC's momentum). Never modifies ``averaged``."""
        return averaged

    def update_uncompressed_(self, averaged: list[torch.Tensor], states: list[dict[str, Any]]) -> None:
        """`update_uncompressed` for several tensors, each replaced in place by its update."""
        for tensor, state in zip(averaged, states, strict=True):
            updated = self.update_uncompressed(tensor, state)
            if updated is not tensor:
                tensor.copy_(updated)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a feedback keeps a gradient of ``dtype`` in: fp32 for half precision, whose 8 or
    11 bits of mantissa would round away a small gradient added to a large held-back one (each
    step's, for good), else the gradient's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def held(state: dict[str, Any], name: str, like: torch.Tensor) -> torch.Tensor:
    """The state's buffer ``name`` in ``like``'s shape, on its device, in `state_dtype`: made
    (zeros) where it holds none of ``like``'s size, converted where it holds one in another dtype or
    on another device (as a checkpoint may). A view of the one buffer a tensor keeps, whichever
    route last made it: a tensor in its own shape (a custom loop's sparse step) or a flat slice (a
    bucket, a dense step's flush) — a route must never find another's state of another shape and
    start over."""
    dtype = state_dtype(like.dtype)
    if not holds(state, name, like):
        state[name] = torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)
    elif (kept := state[name]).device != like.device or kept.dtype != dtype or not kept.is_contiguous():
        state[name] = kept.to(like.device, dtype, memory_format=torch.contiguous_format)  # loaded elsewhere
    buffer: torch.Tensor = state[name]
    return buffer.view(like.shape)


def hold_in(buffer: torch.Tensor, name: str, parts: Sequence[tuple[dict[str, Any], int, int]]) -> list[torch.Tensor]:
    """One buffer for several tensors' states: each part's (state, start, numel) buffer ``name``
    copied into ``buffer[start:start + numel]`` (left as it is where the state keeps none of that
    size), the state then holding that view (as `held` hands it out). Returns the views."""
    views = []
    for state, start, numel in parts:
        view = buffer[start:start + numel]
        kept = state.get(name)
        if isinstance(kept, torch.Tensor) and kept.numel() == numel:
            view.copy_(kept.reshape(-1))
        state[name] = view
        views.append(view)
    return views


def holds(state: dict[str, Any], name: str, like: torch.Tensor) -> bool:
    """Whether the state keeps a buffer ``name`` of ``like``'s size (in whatever dtype: `held`
    gives it in the one it is kept in)."""
    buffer = state.get(name)
    return isinstance(buffer, torch.Tensor) and buffer.numel() == like.numel()


def flush_into(whole: torch.Tensor, out: torch.Tensor, scale: float) -> bool:
    """Write ``whole`` (a feedback's accumulator) times ``scale`` into ``out`` and leave in ``whole``
    what ``out`` lost, in ``whole``'s units; return whether that is nothing (same dtype, no scaling:
    ``whole`` is then zero)."""
    flat = whole.reshape(-1)
    if scale == 1.0 and out.dtype == flat.dtype:
        out.copy_(flat)
        clear_(flat)
        return True
    torch.mul(flat, scale, out=out)  # rounded to out's dtype as it is written
    flat.sub_(out, alpha=1.0 / scale)
    return False


def add_at(state: dict[str, Any], name: str, entries: SparseGradient) -> None:
    """The state's buffer ``name`` [entries] += entries' values, in place (flat positions), the
    buffer made (zeros) where the state holds none of that size: a rank that skipped its non-finite
    gradient this step has not made it yet."""
    values = entries.values
    like = values.new_empty(()).expand(entries.numel)  # the buffer's size, dtype and device, unallocated
    buffer = held(state, name, like)
    buffer.index_add_(0, entries.indices.to(buffer.device), values.to(buffer.device, buffer.dtype))


def subtract_sent(accumulated: torch.Tensor, sent: SparseGradient) -> torch.Tensor:
    """accumulated[sent] −= sent values, in place (exactly zero there when values were sent losslessly);
    returns the flat indices of what was sent, on the accumulator's device."""
    flat = accumulated.view(-1)
    indices = sent.indices.to(flat.device)
    flat.scatter_add_(0, indices, -sent.values.to(flat.device, flat.dtype))
    return indices


FEEDBACKS: Registry[Feedback] = Registry("feedback")
"""every feedback, by name"""
