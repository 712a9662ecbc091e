"""`cumulative`: a running sum along a tensor's first dimension that deterministic algorithms allow.

Under ``torch.use_deterministic_algorithms(True)`` torch refuses a floating-point ``cumsum`` of a
CUDA tensor (its order of additions is not fixed). There the sum runs on the host: one copy each
way and a wait for the device, the price of a result that is the same on every run.
"""

from __future__ import annotations

import torch


def cumulative(values: torch.Tensor) -> torch.Tensor:
    """``values.cumsum(0)``, on the host where deterministic algorithms forbid it on the device."""
    if values.is_cuda and values.is_floating_point() and torch.are_deterministic_algorithms_enabled():
        return values.cpu().cumsum(0).to(values.device)
    return values.cumsum(0)
