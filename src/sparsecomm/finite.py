"""`all_finite`: whether a tensor holds no NaN or ±Inf, at memory speed.

Every gradient passes this check once per step (the ``nonfinite`` policy), and every payload's
values at encode and decode. On the CPU, torch's ``isfinite(x).all()`` is an order of magnitude
slower than numpy's ``isfinite`` for fp32 and fp64, so CPU tensors numpy can view go that way; numpy
computes fp16 in software and has no bf16, so those are read as bits instead: a 16-bit float is
finite exactly when its magnitude bits are below its all-ones exponent.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_FLOATS = (torch.float32, torch.float64)
_HALF_INFINITY_BITS = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
"""per 16-bit float dtype: +Inf's bit pattern, the least magnitude (sign bit cleared) not finite"""


def all_finite(values: torch.Tensor) -> bool:
    """True when no entry of ``values`` is NaN or ±Inf (always for integer and empty tensors)."""
    if values.numel() == 0 or not (values.is_floating_point() or values.is_complex()):
        return True
    if values.device.type == "cpu" and not values.is_sparse:
        if values.dtype in _NUMPY_FLOATS:
            return bool(np.isfinite(values.detach().numpy()).all())
        infinity = _HALF_INFINITY_BITS.get(values.dtype)
        if infinity is not None:
            bits = values.detach().view(torch.int16).numpy().view(np.uint16)
            return int(np.bitwise_and(bits, np.uint16(0x7FFF)).max()) < infinity
    return bool(torch.isfinite(values).all())
