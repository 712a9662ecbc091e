"""The digits workload: scikit-learn's handwritten digits (shipped with the package) and an MLP."""

from __future__ import annotations

from collections.abc import Iterator
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from sparsecomm.errors import SparseCommError
from sparsecomm.train.evaluation import Evaluation
from sparsecomm.train.regime import RESNET50_ON_1GBE


class Digits:
    """scikit-learn's handwritten digits (1,797 8×8 images, shipped with the package): an MLP
    64→512→256→10 (~166k parameters), 1,500 images to train on, 297 held out; metric: accuracy."""

    name = "digits"
    metric_name = "accuracy"
    higher_is_better = True
    optimizer = "sgd"
    learning_rates = MappingProxyType({"sgd": 0.05, "adamw": 1e-3})
    warmup_share = 0.0
    """no warm-up: a constant learning rate (`UpdateRule.schedule`)"""
    default_batch, default_steps = 32, 300
    default_presets = None
    regime = RESNET50_ON_1GBE
    ddp_bucket_mb: float | None = None
    """the size of the DDP buckets its rows train in (None: PyTorch's default)"""
    ddp_broadcast_buffers = True
    """whether DDP sends rank 0's buffers to every rank at each forward (PyTorch's default); where
    not, each rank keeps its own and the ranks average them before evaluating (`average_buffers`)"""

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
        """Accuracy on the held-out images, in evaluation mode (batch normalisation's running
        statistics); the model's mode is left as it was."""
        device = next(model.parameters()).device
        test_x, test_y = self.test_x.to(device), self.test_y.to(device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(test_x)
        finally:
            model.train(was_training)
        accuracy = float((logits.argmax(1) == test_y).float().mean())
        return Evaluation(100.0 * accuracy, float(F.cross_entropy(logits, test_y)))
