"""Training workloads with no download at run time: data shipped by a package."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparsecomm.errors import SparseCommError


@dataclass(frozen=True)
class Evaluation:
    metric: float
    loss: float


class Digits:
    """scikit-learn's handwritten digits (1,797 8×8 images, shipped with the package): an MLP
    64→512→256→10 (~166k parameters), 1,500 images to train on, 297 held out; metric: accuracy."""

    name = "digits"
    metric_name = "accuracy"
    higher_is_better = True

    def __init__(self) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise SparseCommError("the digits workload needs scikit-learn: pip install 'sparsecomm[train]'") from None
        digits = load_digits()
        images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.int64)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        images, labels = images[order], labels[order]
        self.train_x, self.train_y = images[:1500], labels[:1500]
        self.test_x, self.test_y = images[1500:], labels[1500:]

    def model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng():  # initialise from the run's seed without disturbing the caller's RNG
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))

    def batches(self, rank: int, world: int, steps: int, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """Each rank's shard, reshuffled every epoch by a generator all ranks seed alike."""
        generator = torch.Generator().manual_seed(seed)
        shard = torch.arange(rank, len(self.train_y), world)
        position, order = len(shard), shard
        for _ in range(steps):
            if position + batch > len(shard):
                order, position = shard[torch.randperm(len(shard), generator=generator)], 0
            chosen = order[position : position + batch]
            position += batch
            yield self.train_x[chosen], self.train_y[chosen]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels)

    def evaluate(self, model: nn.Module) -> Evaluation:
        with torch.no_grad():
            logits = model(self.test_x)
            accuracy = float((logits.argmax(1) == self.test_y).float().mean())
            return Evaluation(100.0 * accuracy, float(F.cross_entropy(logits, self.test_y)))


WORKLOADS = {"digits": Digits}


def workload(name: str) -> Digits:
    if name not in WORKLOADS:
        raise SparseCommError(f"unknown workload {name!r}; available: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()
