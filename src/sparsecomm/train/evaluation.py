"""What a workload's evaluation reports: its metric (accuracy, perplexity) and the held-out loss."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Evaluation:
    metric: float
    loss: float
