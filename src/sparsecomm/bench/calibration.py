"""Measuring the cost model inside a running group: α and β from a ping-pong between ranks 0 and 1
(α: the one-way time of an 8-byte message; β: the slope from there to the largest message), the
codec and summation rates on rank 0; the result is broadcast so every rank holds the same model."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from sparsecomm.bench.timing import time_ms
from sparsecomm.payload import decode, encode
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.cost_model import CostModel

PING_SIZES = (8, 8 << 20)


def one_way_seconds(rank: int, nbytes: int, repeat: int) -> float:
    buffer = torch.zeros(max(1, nbytes // 4))
    times = []
    for _ in range(repeat + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        times.append((time.perf_counter() - start) / 2)
    return float(np.median(times[1:]))


def compute_rates(seed: int = 0) -> tuple[float, float]:
    """(codec seconds per nonzero for rice + fp32, summation seconds per byte)."""
    generator = torch.Generator().manual_seed(seed)
    numel, nnz = 4_000_000, 40_000
    grad = SparseGradient(torch.randperm(numel, generator=generator)[:nnz], torch.randn(nnz, generator=generator),
                          torch.Size([numel]))
    encode_ms, payload = time_ms(lambda: encode(grad, "rice", "fp32"), 5)
    decode_ms, _ = time_ms(lambda: decode(payload), 5)
    dense = torch.randn(numel, generator=generator)
    sum_ms, _ = time_ms(lambda: torch.zeros(numel).add_(dense), 5)
    return (encode_ms + decode_ms) * 1e-3 / nnz, sum_ms * 1e-3 / (numel * 4)


def calibrate_group(rank: int, world: int, repeat: int = 5) -> CostModel:
    """Collective: every rank returns the same model."""
    fitted: list[object] = [None]
    if world > 1:
        points = [(size, one_way_seconds(rank, size, repeat)) for size in PING_SIZES]
        if rank == 0:
            (small, alpha), (large, large_seconds) = points
            beta = (large_seconds - alpha) / (large - small)
            codec, reduce = compute_rates()
            fitted[0] = CostModel(alpha=max(float(alpha), 1e-6), beta=max(float(beta), 1e-12), codec_per_nnz=codec,
                                  reduce_per_byte=reduce, source="calibrated in this run")
        dist.broadcast_object_list(fitted, src=0)
    else:
        codec, reduce = compute_rates()
        fitted[0] = CostModel(codec_per_nnz=codec, reduce_per_byte=reduce, source="calibrated in this run")
    model = fitted[0]
    assert isinstance(model, CostModel)
    return model
