"""The sparse path's cost per payload byte, timed once at start-up on this rank."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from sparsecomm.payload import decode
from sparsecomm.pipeline import Pipeline


def marginal_sparse_cost(spec: Any, numel: int = 1 << 20, nnz: tuple[int, int] = (2_000, 128_000),
                         repeats: int = 5, attempts: int = 3,
                         clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(sender, receiver) seconds per payload byte that the whole sparse path adds between a small
    and a large selection (``nnz``) of a synthetic ``numel``-element gradient: on the sender, the
    pipeline's step (feedback, selection, encoding, the feedback's update); on a receiver, decoding
    a payload and adding it into the sum. The slope, not the average: what a step costs at any
    budget (a pass over the whole gradient, a call's overhead) cancels out, and counting it per
    byte would make small budgets look dear and shrink them further.

    A busy machine can swamp the slope with noise and time the small selection as the dearer one;
    such a measurement is taken again, up to ``attempts`` times, and a slope that stays negative
    counts as zero. ``clock`` reads seconds."""
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(numel, generator=generator)
    total = torch.zeros(numel)
    pipelines = [Pipeline(spec) for _ in nnz]

    def timed(pipeline: Pipeline, count: int) -> tuple[int, float, float]:
        start = clock()
        payload = pipeline.step(gradient, "calibration", make_payload=True, density=count / numel).payload
        middle = clock()
        assert payload is not None
        received = decode(payload, expect=numel)
        total.scatter_add_(0, received.indices, received.values)
        return len(payload), middle - start, clock() - middle

    def slopes() -> tuple[float, float]:
        best = [(0, math.inf, math.inf) for _ in nnz]
        for _ in range(repeats):  # the sizes alternate, so a slow spell of the machine hits both alike
            for which, (pipeline, count) in enumerate(zip(pipelines, nnz, strict=True)):
                size, send_s, receive_s = timed(pipeline, count)
                best[which] = (size, min(best[which][1], send_s), min(best[which][2], receive_s))
        (small, send_small, receive_small), (large, send_large, receive_large) = best
        span = max(1, large - small)
        return (send_large - send_small) / span, (receive_large - receive_small) / span

    for _ in range(2):  # warm, untimed: a first call allocates and pages in what later ones reuse
        for pipeline, count in zip(pipelines, nnz, strict=True):
            timed(pipeline, count)
    for _ in range(attempts):
        sending, receiving = slopes()
        if sending > 0 and receiving > 0:
            break
    return max(0.0, sending), max(0.0, receiving)
