"""Byte views of torch float tensors (little-endian), shared by the value codecs."""

from __future__ import annotations

import sys

import numpy as np
import torch

from sparsecomm.errors import PayloadError

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("sparsecomm's wire format assumes a little-endian host")

FLOAT_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
DTYPE_BY_CODE = {code: dtype for dtype, code in FLOAT_DTYPES.items()}


def tensor_bytes(values: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor as a (n, itemsize) uint8 array."""
    flat = values.detach().reshape(-1).contiguous().cpu()
    if flat.numel() == 0:
        return np.zeros((0, flat.element_size()), dtype=np.uint8)
    return flat.view(torch.uint8).numpy().reshape(flat.numel(), flat.element_size())


def tensor_from_bytes(data: bytes | memoryview | np.ndarray, dtype: torch.dtype, count: int) -> torch.Tensor:
    """``count`` values of ``dtype`` from exactly ``count * itemsize`` bytes (copied)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    if raw.size != count * itemsize:
        raise PayloadError(f"{count} values of {dtype} need {count * itemsize} bytes, got {raw.size}")
    if count == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.from_numpy(raw.copy()).view(dtype)


def cast_within(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values a lossy codec rebuilt, in ``dtype``, the finite ones beyond its range at its bound: a
    rebuilt value may pass the largest the gradient's dtype holds by the codec's error (QSGD's norm
    times its level, a fitted curve, bf16's rounding of 65504 up), and cast it would be infinite."""
    bound = torch.finfo(dtype).max
    if bound >= torch.finfo(values.dtype).max:
        return values.to(dtype)
    wide = values.to(torch.promote_types(values.dtype, torch.float32))
    return torch.where(wide.isfinite(), wide.clamp(-bound, bound), wide).to(dtype)
