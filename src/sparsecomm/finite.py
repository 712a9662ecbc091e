"""`all_finite`: whether a tensor holds no NaN or ±Inf, at memory speed.

Every gradient passes this check once per step (the ``nonfinite`` policy), and every payload's
values at encode and decode. On the CPU, ``torch.isfinite(x).all()`` took 365 µs for 167k fp32
values here against 18 µs for numpy's ``isfinite``, so CPU tensors numpy can view go that way.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def all_finite(values: torch.Tensor) -> bool:
    """True when no entry of ``values`` is NaN or ±Inf (always for integer and empty tensors)."""
    if values.numel() == 0 or not (values.is_floating_point() or values.is_complex()):
        return True
    if values.device.type == "cpu" and values.dtype in _NUMPY_FLOATS and not values.is_sparse:
        return bool(np.isfinite(values.detach().numpy()).all())
    return bool(torch.isfinite(values).all())
