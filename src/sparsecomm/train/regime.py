"""The network regime the training job's default link imitates: how long a dense all_reduce takes
per second of compute. Each workload names its regime."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Regime:
    """A communication-to-compute ratio, and where it comes from."""

    ratio: float
    """seconds a dense all_reduce's bytes take per second of compute (the ring's 2(P-1)/P factor left
    out: both sides share it at equal P)"""
    described: str


RESNET50_ON_1GBE = Regime(102.2e6 * 8 / 1e9 / 0.055,
                          "ResNet-50 (102 MB of fp32 gradient, ~55 ms per batch-64 step with mixed precision on a "
                          "V100) on 1 Gbit/s Ethernet")
"""a real model on a real cluster network: the digits and lm workloads' default"""

BREAK_EVEN = Regime(1.0, "the link where a dense all_reduce takes as long as the step's compute: compression "
                         "starts to pay there")
"""the gpt workload's default: at ResNet-50's ratio its dense rows alone would take a quarter of an hour
on 2 CPU cores"""


def matching_rate(dense_bytes: float, compute_s: float, regime: Regime) -> float:
    """The link rate (bits/s) at which ``dense_bytes`` per ``compute_s`` of compute has ``regime``'s
    communication-to-compute ratio, rounded to two significant digits."""
    rate = dense_bytes * 8 / (regime.ratio * compute_s)
    return float(f"{rate:.2g}")
