"""A residual CNN with batch normalisation on scikit-learn's digits: the convolutional workload.

The 8×8 images are the digits workload's, with its split; the model is a small ResNet — a stem,
two stages of basic blocks (the second at half the resolution, twice the channels), global average
pooling and a linear classifier — with batch normalisation after every convolution, as ResNets are
trained. Each rank keeps its own normalisation statistics while training and the ranks average them
before evaluating (as timm's ``distribute_bn`` does): DDP's default, a broadcast of rank 0's at
every forward, is one more collective a step, for statistics training never reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsecomm.train.digits import Digits


class DigitsResNet(Digits):
    """scikit-learn's digits as 1×8×8 images through a small ResNet (170k parameters in 32 tensors,
    20 of them normalisation weights and biases): the digits workload's data, split, update rule
    and metric (held-out accuracy), with a convolutional model."""

    name = "cnn"
    ddp_broadcast_buffers = False

    def model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng():  # initialise from the run's seed without disturbing the caller's RNG
            torch.manual_seed(seed)
            return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), ResNet(channels=(32, 64), classes=10))


class ResNet(nn.Module):
    """Stem, one stage of two basic blocks per width (each later stage at stride 2), pooling, classifier."""

    def __init__(self, channels: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, channels[0], 3, padding=1, bias=False), nn.BatchNorm2d(channels[0]),
                                  nn.ReLU())
        blocks, width = [], channels[0]
        for stage, out in enumerate(channels):
            blocks += [BasicBlock(width, out, stride=1 if stage == 0 else 2), BasicBlock(out, out, stride=1)]
            width = out
        self.blocks = nn.Sequential(*blocks)
        self.classifier = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.blocks(self.stem(images)).mean(dim=(2, 3)))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3×3 convolutions with batch normalisation, and a shortcut (a 1×1
    convolution where the shape changes)."""

    def __init__(self, width: int, out: int, stride: int) -> None:
        super().__init__()
        self.first = nn.Conv2d(width, out, 3, stride=stride, padding=1, bias=False)
        self.first_norm = nn.BatchNorm2d(out)
        self.second = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.second_norm = nn.BatchNorm2d(out)
        self.shortcut = nn.Identity() if stride == 1 and width == out else nn.Sequential(
            nn.Conv2d(width, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.first_norm(self.first(inputs)))
        return F.relu(self.second_norm(self.second(hidden)) + self.shortcut(inputs))
