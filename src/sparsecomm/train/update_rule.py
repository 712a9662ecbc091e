"""The update rule every row of a training run shares: SGD with Nesterov momentum, or AdamW — and,
for a pipeline that applies SGD's momentum itself (DGC's), the form of it that suits the optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from sparsecomm.errors import SparseCommError
from sparsecomm.spec import PipelineSpec
from sparsecomm.train.baselines import has_sparse_gradients
from sparsecomm.train.workloads import Workload

MOMENTUM = 0.9
"""SGD's Nesterov momentum, applied by the optimizer or by a pipeline that corrects it (DGC's)"""

WEIGHT_DECAY = 0.01
"""AdamW's decoupled weight decay (PyTorch's default)"""

OPTIMIZERS = ("sgd", "adamw")


class Suitable(Protocol):
    """What an update rule asks of a reducer (`GradientReducer`, `HierarchicalReducer`, `FSDPCompression`)."""

    @property
    def spec(self) -> PipelineSpec: ...

    def suit_optimizer(self, optimizer: torch.optim.Optimizer) -> str | None: ...


@dataclass(frozen=True)
class UpdateRule:
    """The optimizer every row trains with, its learning rate, and the share of the steps it warms up
    over (0: constant)."""

    optimizer: str
    lr: float
    warmup_share: float = 0.0

    @classmethod
    def of(cls, task: Workload, optimizer: str | None = None, lr: float | None = None) -> UpdateRule:
        """The rule for ``task``: its own optimizer and learning rate unless told otherwise.

        Raises:
            SparseCommError: an unknown optimizer, no known learning rate for the pair, or AdamW on
                a model with sparse gradients (PyTorch's AdamW takes none)."""
        optimizer = optimizer or task.optimizer
        if optimizer not in OPTIMIZERS:
            raise SparseCommError(f"unknown optimizer {optimizer!r}; use {' or '.join(OPTIMIZERS)}")
        name, rates = task.name, task.learning_rates
        if optimizer == "adamw" and has_sparse_gradients(task.model(0)):
            raise SparseCommError(f"the {name} workload has sparse gradients, which PyTorch's AdamW does not take: "
                                  "use --optimizer sgd")
        if lr is None and optimizer not in rates:
            raise SparseCommError(f"no default learning rate for {name} under {optimizer}: pass --lr")
        return cls(optimizer, rates[optimizer] if lr is None else lr, task.warmup_share)

    def build(self, model: nn.Module, reducer: Suitable | None) -> tuple[torch.optim.Optimizer, str | None]:
        """The row's optimizer over ``model``, and why ``reducer``'s feedback changed to suit it
        (None: it did not)."""
        if self.optimizer == "adamw":
            adamw = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=WEIGHT_DECAY)
            return adamw, reducer.suit_optimizer(adamw) if reducer is not None else None
        # SGD: the momentum applied by the optimizer or, for a pipeline that corrects it itself, by the
        # pipeline with plain SGD after it
        applies = reducer is not None and reducer.spec.feedback.applies_momentum
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.0 if applies else MOMENTUM,
                               nesterov=not applies), None

    def describe(self) -> str:
        """E.g. 'adamw at lr 0.001, warm-up over 10% of the steps, then cosine decay to a tenth'."""
        warmup = (f", warm-up over {self.warmup_share:.0%} of the steps, then cosine decay to a tenth"
                  if self.warmup_share else "")
        return f"{self.optimizer} at lr {self.lr:g}{warmup}"

    def schedule(self, optimizer: torch.optim.Optimizer, steps: int) -> LambdaLR | None:
        """The learning rate over ``steps`` steps (None: constant): with a warm-up, rising linearly
        to ``lr`` over `warmup_share` of the steps (W of them: lr/W first), then a cosine decay to
        a tenth by the last step — GPT's recipe, without which AdamW's first full-size steps set a
        transformer back."""
        if not self.warmup_share:
            return None
        warmup = max(1, round(self.warmup_share * steps))

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, steps - warmup))
            return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

        return LambdaLR(optimizer, factor)
