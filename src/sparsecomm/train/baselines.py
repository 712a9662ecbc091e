"""PyTorch's own DDP communication, as rows of `sparsecomm train`: what a user would pick instead.

- ``torch-allreduce``: DDP with no hook (its built-in fp32 allreduce; sparse gradients too).
- ``torch-fp16``: ``default_hooks.fp16_compress_hook`` (gradients cast to fp16 for the allreduce).
- ``torch-powersgd-r1`` / ``-r2``: ``powerSGD_hook`` at matrix rank 1 or 2, with error feedback and
  warm start, as PyTorch recommends. PowerSGD runs vanilla allreduce for its first
  `POWERSGD_START_ITER` steps (PyTorch's ``start_powerSGD_iter``; 2 is the least DDP allows with
  error feedback, and the fastest start to a loss target, see the module's tests and notes).

Two limits of PyTorch's hooks, each reported in the table rather than run: neither the fp16 nor
the PowerSGD hook takes sparse gradients (``Embedding(sparse=True)``): fp16's fails in its
decompress step and PowerSGD's waits forever on gloo. PowerSGD on gloo also aborts with a
"collective mismatch" when DDP has two buckets in flight; the documented workaround, used here, is
one bucket (``bucket_cap_mb`` large enough for the whole model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

POWERSGD_START_ITER = 2
"""PowerSGD's ``start_powerSGD_iter``: vanilla allreduce before this step"""


class BytesMeter:
    """Counts the bytes one rank hands to the allreduce(s) of a PyTorch hook: the tensor sizes on the
    wire format, the same measure `GradientReducer.stats` reports for sparsecomm's transports."""

    def __init__(self, count: Callable[[int], int]) -> None:
        self._count = count
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    @property
    def bytes_sent(self) -> int:
        return self._count(self.steps)


@dataclass(frozen=True)
class Baseline:
    """One PyTorch communication scheme: how to build its DDP and register its hook."""

    name: str
    description: str
    takes_sparse: bool
    one_bucket: bool = False
    powersgd_rank: int = 0
    fp16: bool = False

    def why_not(self, sparse_gradients: bool) -> str | None:
        """Why this baseline cannot run on a model (None: it can)."""
        if sparse_gradients and not self.takes_sparse:
            return f"{self.name} cannot run here: PyTorch's hook does not take sparse gradients"
        return None

    def wrap(self, module: torch.nn.Module, ddp_options: Mapping[str, Any] | None = None
             ) -> tuple[DistributedDataParallel, BytesMeter]:
        """``module`` in DDP with this scheme's hook, and a meter of the bytes it sends; DDP built
        with ``ddp_options`` (the workload's, `ddp_options`), its bucket size overridden where the
        scheme needs one bucket."""
        numel = sum(p.numel() for p in module.parameters())
        options: dict[str, Any] = dict(ddp_options or {})
        if self.one_bucket:
            options["bucket_cap_mb"] = max(1.0, 2 * numel * 4 / 2**20)  # one bucket: PowerSGD's gloo workaround
        model = DistributedDataParallel(module, **options)
        if self.powersgd_rank:
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=POWERSGD_START_ITER, use_error_feedback=True, warm_start=True, random_seed=0)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

            def powersgd_bytes(steps: int) -> int:
                # vanilla allreduce before the start step; afterwards what PowerSGD itself counts
                return 4 * (numel * min(steps, POWERSGD_START_ITER) + state.total_numel_after_compression)

            return model, BytesMeter(powersgd_bytes)
        if self.fp16:
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            return model, BytesMeter(lambda steps: 2 * numel * steps)
        return model, BytesMeter(lambda steps: 4 * numel * steps)


BASELINES: dict[str, Baseline] = {
    baseline.name: baseline for baseline in (
        Baseline("torch-allreduce", "DDP's built-in fp32 allreduce (no hook)", takes_sparse=True),
        Baseline("torch-fp16", "DDP's fp16_compress_hook", takes_sparse=False, fp16=True),
        Baseline("torch-powersgd-r1", "DDP's PowerSGD hook, rank 1, error feedback, warm start",
                 takes_sparse=False, one_bucket=True, powersgd_rank=1),
        Baseline("torch-powersgd-r2", "DDP's PowerSGD hook, rank 2, error feedback, warm start",
                 takes_sparse=False, one_bucket=True, powersgd_rank=2),
    )
}
"""every PyTorch baseline, by row name"""

SHORT_NAMES = {name.removeprefix("torch-"): name for name in BASELINES}
"""``--baselines`` takes the names without their ``torch-`` prefix: allreduce, fp16, powersgd-r1, …"""


def has_sparse_gradients(module: torch.nn.Module) -> bool:
    """Whether any parameter of ``module`` gets a sparse gradient (``Embedding(sparse=True)`` and kin)."""
    return any(getattr(m, "sparse", False) is True for m in module.modules())
