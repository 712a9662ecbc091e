"""Measuring the cost model inside a running group: α and β from a ping-pong between ranks 0 and 1
(α: the least one-way time of an 8-byte message; β: the slope from there to the largest message); the
compute rates on every rank at once, slowest kept — so ranks that share cores are measured sharing
them — and the result is broadcast so every rank holds the same model."""

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
    """Half the least round trip of ``repeat`` ping-pongs (after an untimed one). A floor and a cost
    model need what the link itself takes; a longer sample holds a stall on top of it (a thread
    waiting for a processor: on a host whose cores the ranks keep busy, a round trip that takes
    0.3 ms now and then takes 3), and a median of a few such samples can land on the stalls."""
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
    return min(times[1:])


def compute_rates(seed: int = 0) -> dict[str, float]:
    """The compute rates of the cost model, measured at the sizes transports meet."""
    from sparsecomm.transport.sketch_allreduce import SketchHashes

    generator = torch.Generator().manual_seed(seed)
    numel, nnz = 16_000_000, 160_000
    grad = SparseGradient(torch.randperm(numel, generator=generator)[:nnz], torch.randn(nnz, generator=generator),
                          torch.Size([numel]))
    encode_ms, payload = time_ms(lambda: encode(grad, "rice", "fp32"), 3)
    decode_ms, _ = time_ms(lambda: decode(payload), 3)
    dense = torch.randn(numel, generator=generator)
    pass_ms, _ = time_ms(lambda: torch.zeros(numel).add_(dense), 3)  # allocate + one read-modify-write
    doubled = torch.cat([grad.indices, torch.randperm(numel, generator=generator)[:nnz]])
    values = torch.randn(2 * nnz, generator=generator)

    def merge() -> torch.Tensor:
        unique, inverse = torch.unique(doubled, sorted=True, return_inverse=True)
        return torch.zeros(unique.numel()).index_add_(0, inverse, values)

    sort_ms, _ = time_ms(merge, 3)
    from sparsecomm.encode.value.qsgd import QSGDValues

    quantizer, quantized = QSGDValues(bits=4, bucket=1024), dense[: numel // 8]
    quantize_ms, levels = time_ms(lambda: quantizer.encode(quantized, np.random.default_rng(seed)), 3)
    dequantize_ms, _ = time_ms(lambda: quantizer.decode(memoryview(levels), quantized.numel(), torch.float32), 3)
    positions = torch.randperm(numel, generator=generator)[: 10 * nnz]  # out of cache, as in a real decode
    hash_ms, _ = time_ms(lambda: SketchHashes(0, 1).buckets_and_signs(positions, 1 << 20), 3)
    return {
        "codec_per_nnz": (encode_ms + decode_ms) * 1e-3 / nnz,
        "pass_per_byte": pass_ms * 1e-3 / (2 * numel * 4),
        "sort_per_entry": sort_ms * 1e-3 / (2 * nnz),
        "hash_per_entry": hash_ms * 1e-3 / (2 * 10 * nnz),
        "quantize_per_value": quantize_ms * 1e-3 / quantized.numel(),
        "dequantize_per_value": dequantize_ms * 1e-3 / quantized.numel(),
    }


def calibrate_group(rank: int, world: int, repeat: int = 5) -> CostModel:
    """Collective: every rank returns the same model."""
    if world == 1:
        return CostModel(**compute_rates(), source="calibrated in this run")
    points = [(size, one_way_seconds(rank, size, repeat)) for size in PING_SIZES]
    dist.barrier()
    rates = compute_rates()
    slowest = torch.tensor(list(rates.values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    link = torch.zeros(2, dtype=torch.float64)  # rank 0's fit of its own pings: (alpha, beta), as numbers
    if rank == 0:
        (small, alpha), (large, large_seconds) = points
        link[0], link[1] = max(float(alpha), 1e-6), max(float((large_seconds - alpha) / (large - small)), 1e-12)
    dist.broadcast(link, src=0)
    alpha, beta = link.tolist()
    return CostModel(alpha=alpha, beta=beta, **dict(zip(rates, slowest.tolist(), strict=True)),
                     source="calibrated in this run")
