"""The link's throughput, timed once at start-up: the adaptive controller can then plan its first
steps without a dense step to measure the link (on a slow link that one step can cost as much as
tens of sparse ones)."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

PROBE_REPEATS = 3
MIN_PROBE_NUMEL, MAX_PROBE_NUMEL = 1 << 14, 1 << 18
"""the probe all_reduces as many fp32 elements as the model has, within these bounds (64 kB to
1 MB): large enough that the link's throughput, not its latency, sets the time"""


def probe_numel(model_numel: int | None) -> int:
    """Elements one probe all_reduce carries for a model of ``model_numel`` elements (None: unknown)."""
    return min(MAX_PROBE_NUMEL, max(MIN_PROBE_NUMEL, model_numel or MAX_PROBE_NUMEL))


def link_throughput(group: dist.ProcessGroup | None, numel: int, device: torch.device,
                    dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> list[float]:
    """Wire bytes per second of an all_reduce of ``numel`` elements in each of ``dtypes`` (each
    rank's link carries 2(P−1)/P of the tensor, as the adaptive budget counts it): the slowest rank's
    best of `PROBE_REPEATS` timed calls after one untimed one, the same on every rank. The dtypes'
    calls alternate, so a slow spell of the machine hits them alike. fp16 tells whether half the
    bytes take half the time: gloo sums fp16 on the processor, and on a fast link an fp16
    all_reduce can take as long as an fp32 one."""
    size = dist.get_world_size(group)
    tensors = [torch.zeros(numel, device=device, dtype=dtype) for dtype in dtypes]
    best = [math.inf] * len(tensors)
    for repeat in range(PROBE_REPEATS + 1):
        for index, tensor in enumerate(tensors):
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if repeat:  # the first call sets up connections and buffers
                best[index] = min(best[index], time.perf_counter() - start)
    slowest = torch.tensor(best, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return [2 * (size - 1) / size * tensor.element_size() * numel / max(seconds, 1e-9)
            for tensor, seconds in zip(tensors, slowest.tolist(), strict=True)]
