"""Timing helpers: median wall time of repeated calls, after a warm-up call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def time_ms(fn: Callable[[], T], repeat: int = 5) -> tuple[float, T]:
    """(median milliseconds over ``repeat`` calls, last result); one untimed warm-up call first."""
    result = fn()
    times = []
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result
