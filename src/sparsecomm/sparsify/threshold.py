"""``threshold``: every entry with |g| ≥ value (Strom's fixed threshold)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, Sparsifier, gather, gpu_kernels

_CHUNK = 1 << 20  # elements per cache-sized block in the CPU pass


class _MaskBuffers(threading.local):
    """Scratch buffers reused across calls of the CPU pass, one pair per thread."""

    def __init__(self) -> None:
        self.magnitudes = np.empty(_CHUNK, dtype=np.float32)
        self.mask = np.empty(_CHUNK, dtype=bool)


_BUFFERS = _MaskBuffers()


def indices_at_or_above(flat: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Flat indices, ascending, with |x| ≥ threshold (a number, or a 0-d tensor on ``flat``'s device).
    On the CPU: one cache-blocked numpy pass that never materialises |x| for the whole tensor
    (cache-resident, unlike abs → ge → nonzero in torch). On a GPU with Triton: one pass that writes
    the mask (`sparsecomm.sparsify.cuda_select`)."""
    if (kernels := gpu_kernels(flat, "cuda_select")) is not None:
        return kernels.indices_at_or_above(flat.reshape(-1), threshold)
    if flat.device.type != "cpu" or flat.dtype != torch.float32:
        return torch.nonzero(flat.abs() >= threshold).squeeze(1)
    return torch.from_numpy(host_indices_at_or_above(flat.detach().numpy(), float(threshold)))


def host_indices_at_or_above(values: np.ndarray, threshold: float) -> np.ndarray:
    """`indices_at_or_above` of a float32 array in the CPU's memory (int64, ascending): a pass per
    cache-sized block, the magnitudes and the mask in reused scratch buffers."""
    found = []
    magnitudes, mask = _BUFFERS.magnitudes, _BUFFERS.mask
    for start in range(0, values.size, _CHUNK):
        block = values[start : start + _CHUNK]
        n = block.size
        np.abs(block, out=magnitudes[:n])
        np.greater_equal(magnitudes[:n], threshold, out=mask[:n])
        hits = np.flatnonzero(mask[:n])
        if hits.size:
            found.append(hits + start)
    merged = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    return merged.astype(np.int64, copy=False)


@SPARSIFIERS.register("threshold")
@dataclass(frozen=True)
class Threshold(Sparsifier):
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.value <= 0:
            raise SparseCommError("threshold value must be > 0")

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        indices = indices_at_or_above(tensor.reshape(-1), self.value).to(tensor.device)
        return gather(tensor, indices)
