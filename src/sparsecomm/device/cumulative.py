"""`cumulative`: a running sum along a tensor's first dimension that deterministic algorithms allow.

Under ``torch.use_deterministic_algorithms(True)`` torch's documentation lists a floating-point
``cumsum`` of a CUDA tensor among the operations that raise. Where torch does raise, the sum runs
on the host: one copy each way and a wait for the device, the price of a result that is the same
on every run. Where it does not (torch versions that give the kernel a deterministic path, or the
mode's ``warn_only``), the sum stays on the device.
"""

from __future__ import annotations

import torch


def cumulative(values: torch.Tensor) -> torch.Tensor:
    """``values.cumsum(0)``, on the host where deterministic algorithms forbid it on the device."""
    if not (values.is_cuda and values.is_floating_point() and torch.are_deterministic_algorithms_enabled()):
        return values.cumsum(0)
    try:
        return values.cumsum(0)
    except RuntimeError as error:
        if "deterministic" not in str(error):
            raise
        return values.cpu().cumsum(0).to(values.device)
