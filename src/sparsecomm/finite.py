"""`all_finite`: whether a tensor holds no NaN or ±Inf, and `largest_magnitude`: its largest |entry|,
both at memory speed.

Every gradient passes this check once per step (the ``nonfinite`` policy), and every payload's
values at encode and decode. On the CPU, torch's ``isfinite(x).all()`` is an order of magnitude
slower than numpy's ``isfinite`` for fp32 and fp64, and torch's sum is faster still: a sum is
finite only if every term is (IEEE arithmetic never turns NaN or Inf back into a finite number), so
a finite sum answers at once and only a non-finite one (a NaN or Inf, or an overflow of large finite
values) is checked element by element in numpy. numpy computes fp16 in software and has no bf16, so
those are read as bits instead: a 16-bit float is finite exactly when its magnitude bits are below
its all-ones exponent.
"""

from __future__ import annotations

import math

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
        host = values.detach()
        if host.dtype in _NUMPY_FLOATS:
            # a NaN or Inf makes the sum NaN or Inf, so a finite sum settles it in one vectorised
            # reduction; a non-finite one may be overflow of finite values: then each is checked
            return math.isfinite(float(host.sum())) or bool(np.isfinite(host.numpy()).all())
        infinity = _HALF_INFINITY_BITS.get(host.dtype)
        if infinity is not None:
            bits = host.view(torch.int16).numpy().view(np.uint16)
            return int(np.bitwise_and(bits, np.uint16(0x7FFF)).max()) < infinity
    return bool(torch.isfinite(values).all())


def largest_magnitude(values: torch.Tensor) -> torch.Tensor:
    """The largest |entry| of a non-empty tensor, 0-d on its device, NaN where an entry is NaN: one
    `torch.aminmax` pass, where a CPU takes about 25 times as long over ``vector_norm``'s inf norm
    (2.6 ms against 0.11 for a million fp32 entries on one core)."""
    low, high = torch.aminmax(values)
    return torch.maximum(high, -low)
