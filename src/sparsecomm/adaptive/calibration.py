"""The sparse path's cost per payload byte, timed once at start-up on this rank."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from sparsecomm.payload import decode
from sparsecomm.pipeline import Pipeline


def marginal_sparse_cost(spec: Any, numel: int = 1 << 20, nnz: tuple[int, int] = (2_000, 128_000),
                         repeats: int = 5) -> tuple[float, float]:
    """(sender, receiver) seconds per payload byte that the whole sparse path adds between a small
    and a large selection (``nnz``) of a synthetic ``numel``-element gradient: on the sender, the
    pipeline's step (feedback, selection, encoding, the feedback's update); on a receiver, decoding
    a payload and adding it into the sum. The slope, not the average: what a step costs at any
    budget (a pass over the whole gradient, a call's overhead) cancels out, and counting it per
    byte would make small budgets look dear and shrink them further."""
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(numel, generator=generator)
    total = torch.zeros(numel)
    pipelines = [Pipeline(spec) for _ in nnz]

    def timed(pipeline: Pipeline, count: int) -> tuple[int, float, float]:
        start = time.perf_counter()
        payload = pipeline.step(gradient, "calibration", make_payload=True, density=count / numel).payload
        middle = time.perf_counter()
        assert payload is not None
        received = decode(payload, expect=numel)
        total.scatter_add_(0, received.indices, received.values)
        return len(payload), middle - start, time.perf_counter() - middle

    for _ in range(2):  # warm, untimed: a first call allocates and pages in what later ones reuse
        for pipeline, count in zip(pipelines, nnz, strict=True):
            timed(pipeline, count)
    best = [(0, math.inf, math.inf) for _ in nnz]
    for _ in range(repeats):  # the sizes alternate, so a slow spell of the machine hits both alike
        for which, (pipeline, count) in enumerate(zip(pipelines, nnz, strict=True)):
            size, send_s, receive_s = timed(pipeline, count)
            best[which] = (size, min(best[which][1], send_s), min(best[which][2], receive_s))
    (small, send_small, receive_small), (large, send_large, receive_large) = best
    span = max(1, large - small)
    return max(0.0, (send_large - send_small) / span), max(0.0, (receive_large - receive_small) / span)
