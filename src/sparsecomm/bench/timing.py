"""Timing helpers: median wall time of repeated calls, after a warm-up call; on a GPU each call is
timed to the end of the work it queued."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def time_ms(fn: Callable[[], T], repeat: int = 5, device: torch.device | str = "cpu") -> tuple[float, T]:
    """(median milliseconds over ``repeat`` calls, last result); one untimed warm-up call first.
    On a CUDA ``device`` the clock stops once the device has finished what the call queued."""
    cuda = torch.device(device).type == "cuda"

    def finished() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    result = fn()
    times = []
    for _ in range(max(1, repeat)):
        start = finished()
        result = fn()
        times.append((finished() - start) * 1e3)
    return statistics.median(times), result
