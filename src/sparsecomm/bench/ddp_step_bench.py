"""``sparsecomm bench ddp-step``: one DDP training step (forward, backward with the communication
hook, optimizer) with each preset as the hook, next to DDP's own allreduce, on one device.

On a GPU this runs NCCL (one rank per GPU; with one GPU, one rank: the link is then free and what
remains is each hook's own cost — sparsify, feedback, the device-to-host copy, the codecs); on the
CPU, gloo. The model is a stack of square linear layers of ``width`` holding about ``numel``
parameters (25.6M of width 2048 by default, ResNet-50's size), batch 64. PyTorch's own hooks
(``baselines``: fp16, PowerSGD) run as rows too. With ``count``, each row's steps are also counted
(`sparsecomm.bench.op_counts`): aten ops, host syncs and (on a GPU) host↔device bytes per step,
after the timed steps."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from sparsecomm.bench.op_counts import count_ops
from sparsecomm.bench.timing import time_ms
from sparsecomm.launch import run_local
from sparsecomm.train.baselines import BASELINES

WIDTH, BATCH, MAX_LAYERS = 2048, 64, 64
BASELINE = "ddp-allreduce"


def layers_for(numel: int, width: int = WIDTH) -> int:
    """The model's layers: enough of ``width`` to hold about ``numel`` parameters, at most `MAX_LAYERS`."""
    return max(1, min(MAX_LAYERS, math.ceil(numel / (width * width + width))))


def model_of(numel: int, device: str, width: int = WIDTH) -> nn.Module:
    """Square linear layers of ``width`` (ReLU between them) holding about ``numel`` parameters, the
    same weights for every row (from a seeded generator of their own)."""
    layers = layers_for(numel, width)
    stack: list[nn.Module] = []
    for index in range(layers):
        stack += [nn.Linear(width, width)] + ([nn.ReLU()] if index < layers - 1 else [])
    model = nn.Sequential(*stack)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(width))
    return model.to(device)


def run(presets: list[str], numel: int, device: str = "cpu", repeat: int = 10, workers: int = 1,
        width: int = WIDTH, baselines: tuple[str, ...] = (), count: bool = False) -> dict[str, Any]:
    """Median step time of each preset's hook, of PyTorch's ``baselines`` and of DDP's allreduce,
    side by side in one run; with ``count``, their ops, host syncs and host↔device bytes per step too."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    results = run_local(workers, _steps, [*baselines, *presets], numel, device, repeat, width, count,
                        backend=backend, timeout=1800)
    rows = results[0]
    for row, *others in zip(*results, strict=True):  # the slowest rank's time
        row["ms"] = max([row["ms"], *(other["ms"] for other in others)])
    baseline = next(row["ms"] for row in rows if row["preset"] == BASELINE)
    for row in rows:
        row["vs_allreduce"] = baseline / row["ms"] if row["ms"] > 0 else float("inf")
    return {"benchmark": "ddp-step", "device": device, "backend": backend, "workers": workers,
            "parameters": rows[0]["parameters"], "tensors": rows[0]["tensors"], "batch": BATCH, "repeat": repeat,
            "rows": rows}


def _steps(rank: int, world: int, presets: list[str], numel: int, device: str, repeat: int, width: int,
           count: bool) -> list[dict[str, Any]]:
    import sparsecomm as sc

    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(BATCH, width, generator=generator).to(device)
    rows = []
    for preset in [BASELINE, *presets]:
        model = model_of(numel, device, width)
        reducer = None
        if preset in BASELINES:
            ddp, _ = BASELINES[preset].wrap(model)
        else:
            ddp = nn.parallel.DistributedDataParallel(model)
            if preset != BASELINE:
                reducer = sc.GradientReducer(preset, model=ddp)
                ddp.register_comm_hook(reducer, sc.ddp_comm_hook)
        step = partial(_step, ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), inputs)
        ms, _ = time_ms(step, repeat, device)
        row = {"preset": preset, "ms": ms, "parameters": sum(p.numel() for p in model.parameters()),
               "tensors": len(list(model.parameters()))}
        if count:
            counted = count_ops(step, repeat, device)
            row |= {"ops_per_step": counted.ops, "syncs_per_step": counted.syncs,
                    "host_device_bytes_per_step": counted.host_device_bytes}
        rows.append(row)
        if reducer is not None:
            reducer.close()
    return rows


def _step(ddp: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    optimizer.zero_grad()
    ddp(inputs).square().mean().backward()
    optimizer.step()
