"""The feedback interface: turn this step's gradient into the tensor to sparsify, then learn what
was sent."""

from __future__ import annotations

from typing import Any

import torch

from sparsecomm.registry import Component, Registry
from sparsecomm.sparse_gradient import SparseGradient


class Feedback(Component):
    def accumulate(self, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The tensor to sparsify this step. Never modifies ``grad``."""
        raise NotImplementedError

    def update(self, accumulated: torch.Tensor, sent: SparseGradient, state: dict[str, Any]) -> None:
        """Record that ``sent`` (indices and the values the receivers will decode) left."""
        raise NotImplementedError

    def update_uncompressed(self, averaged: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The update for a tensor the reducer sends without this pipeline (small tensors, sparse
        embedding rows), given its average over ranks: the average itself, unless this feedback
        owns something the optimizer lacks (DGC's momentum). Never modifies ``averaged``."""
        return averaged


def subtract_sent(accumulated: torch.Tensor, sent: SparseGradient) -> torch.Tensor:
    """accumulated[sent] −= sent values, in place (exactly zero there when values were sent losslessly);
    returns the flat indices of what was sent, on the accumulator's device."""
    flat = accumulated.view(-1)
    indices = sent.indices.to(flat.device)
    flat.index_put_((indices,), -sent.values.to(flat.device, flat.dtype), accumulate=True)
    return indices


FEEDBACKS: Registry[Feedback] = Registry("feedback")
"""every feedback, by name"""
