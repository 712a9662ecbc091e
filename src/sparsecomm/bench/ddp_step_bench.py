"""``sparsecomm bench ddp-step``: one DDP training step (forward, backward with the communication
hook, optimizer) with each preset as the hook, next to DDP's own allreduce, on one device.

On a GPU this runs NCCL (one rank per GPU; with one GPU, one rank: the link is then free and what
remains is each hook's own cost — sparsify, feedback, the device-to-host copy, the codecs); on the
CPU, gloo. The model is a stack of square linear layers holding about ``numel`` parameters
(25.6M by default, ResNet-50's size), batch 64."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from sparsecomm.bench.timing import time_ms
from sparsecomm.launch import run_local

WIDTH, BATCH, MAX_LAYERS = 2048, 64, 64
BASELINE = "ddp-allreduce"


def model_of(numel: int, device: str) -> nn.Module:
    """Square linear layers of `WIDTH` (ReLU between them) holding about ``numel`` parameters, the
    same weights for every row (from a seeded generator of their own)."""
    layers = max(1, min(MAX_LAYERS, math.ceil(numel / (WIDTH * WIDTH + WIDTH))))
    stack: list[nn.Module] = []
    for index in range(layers):
        stack += [nn.Linear(WIDTH, WIDTH)] + ([nn.ReLU()] if index < layers - 1 else [])
    model = nn.Sequential(*stack)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(WIDTH))
    return model.to(device)


def run(presets: list[str], numel: int, device: str = "cpu", repeat: int = 10, workers: int = 1) -> dict[str, Any]:
    """Median step time of each preset's hook and of DDP's allreduce, side by side in one run."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    results = run_local(workers, _steps, presets, numel, device, repeat, backend=backend, timeout=1800)
    rows = results[0]
    for row, *others in zip(*results, strict=True):  # the slowest rank's time
        row["ms"] = max([row["ms"], *(other["ms"] for other in others)])
    baseline = next(row["ms"] for row in rows if row["preset"] == BASELINE)
    for row in rows:
        row["vs_allreduce"] = baseline / row["ms"] if row["ms"] > 0 else float("inf")
    return {"benchmark": "ddp-step", "device": device, "backend": backend, "workers": workers,
            "parameters": rows[0]["parameters"], "batch": BATCH, "repeat": repeat, "rows": rows}


def _steps(rank: int, world: int, presets: list[str], numel: int, device: str, repeat: int) -> list[dict[str, Any]]:
    import sparsecomm as sc

    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(BATCH, WIDTH, generator=generator).to(device)
    rows = []
    for preset in [BASELINE, *presets]:
        model = model_of(numel, device)
        ddp = nn.parallel.DistributedDataParallel(model)
        reducer = None
        if preset != BASELINE:
            reducer = sc.GradientReducer(preset, model=ddp)
            ddp.register_comm_hook(reducer, sc.ddp_comm_hook)
        ms, _ = time_ms(partial(_step, ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), inputs), repeat, device)
        rows.append({"preset": preset, "ms": ms, "parameters": sum(p.numel() for p in model.parameters())})
        if reducer is not None:
            reducer.close()
    return rows


def _step(ddp: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    optimizer.zero_grad()
    ddp(inputs).square().mean().backward()
    optimizer.step()
