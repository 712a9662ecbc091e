"""Gradients to benchmark on: synthetic distributions, a real backward pass, or a saved array."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from sparsecomm.errors import SparseCommError

SOURCES = ("normal", "laplace", "mlp")


def make_gradient(source: str, numel: int, seed: int = 0) -> torch.Tensor:
    """A flat float32 gradient of ``numel`` entries.

    ``normal`` / ``laplace``: i.i.d. draws. ``mlp``: the real gradient of a 784→h→h→10 ReLU MLP
    (h sized so it has at least ``numel`` parameters, first ``numel`` kept) on one batch of
    generated, class-structured data. A path ending in ``.npy``: that array, flattened.
    """
    generator = torch.Generator().manual_seed(seed)
    if source == "normal":
        return torch.randn(numel, generator=generator)
    if source == "laplace":
        uniform = torch.rand(numel, generator=generator, dtype=torch.float64) - 0.5
        return (-torch.sign(uniform) * torch.log1p(-2 * uniform.abs())).to(torch.float32)
    if source == "mlp":
        return _mlp_gradient(numel, generator)
    if source.endswith(".npy"):
        path = Path(source)
        if not path.is_file():
            raise SparseCommError(f"no such gradient file: {source}")
        array = np.load(path, allow_pickle=False)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(-1))
    raise SparseCommError(f"unknown source {source!r}; use one of {', '.join(SOURCES)} or a .npy path")


def _mlp_gradient(numel: int, generator: torch.Generator) -> torch.Tensor:
    inputs, classes, batch = 784, 10, 128
    hidden = max(16, math.ceil((-(inputs + classes + 2) + math.sqrt((inputs + classes + 2) ** 2 + 4 * numel)) / 2))
    layers = [torch.nn.Linear(inputs, hidden), torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, classes)]
    with torch.no_grad():
        for layer in layers:
            bound = 1.0 / math.sqrt(layer.in_features)
            layer.weight.uniform_(-bound, bound, generator=generator)
            layer.bias.uniform_(-bound, bound, generator=generator)
    centers = torch.randn(classes, inputs, generator=generator)
    labels = torch.randint(classes, (batch,), generator=generator)
    data = centers[labels] + 0.5 * torch.randn(batch, inputs, generator=generator)
    hidden1 = torch.relu(layers[0](data))
    logits = layers[2](torch.relu(layers[1](hidden1)))
    loss = torch.nn.functional.cross_entropy(logits, labels)
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    grads = torch.autograd.grad(loss, params)
    flat = torch.cat([g.reshape(-1) for g in grads])
    return flat[:numel].contiguous()
