"""The DDP communication hook: ``sparsecomm.register_ddp_hook(ddp_model, "dgc")``.

DDP hands the hook one bucket at a time (a flat tensor of gradients, not yet divided by the world
size; a sparse COO tensor for ``Embedding(sparse=True)``) and waits on the returned future for the
averaged bucket. The reducer keeps per-bucket state keyed by bucket index; DDP rebuilds its buckets
once after the first iteration, and state whose size no longer fits is started afresh. Inside
``no_sync()`` DDP does not call the hook: the gradients accumulate and the next synchronised step
sends their sum.
"""

# No "from __future__ import annotations" here: DDP checks that the hook's ``bucket`` annotation *is*
# dist.GradBucket, which a postponed (string) annotation is not.
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sparsecomm.integration.reducer import DENSE_BELOW, GradientReducer
from sparsecomm.spec import PipelineSpec


def sparsecomm_hook(state: GradientReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook (plain function: DDP rejects partials and callable objects)."""
    if bucket.is_last():
        state.step_done()
    return state.reduce_async(f"bucket{bucket.index()}", bucket.buffer())


def register_ddp_hook(ddp_model: DistributedDataParallel, spec_or_preset: str | PipelineSpec, *, seed: int = 0,
                      nonfinite: str = "raise", dense_below: int = DENSE_BELOW, **options: Any) -> GradientReducer:
    """Register a pipeline (spec string or preset name) on a DDP model; returns its state, which
    holds the statistics and has ``state_dict()`` / ``load_state_dict()`` for checkpoints."""
    if options:
        raise TypeError(f"unknown options {sorted(options)}; use seed=, nonfinite=, dense_below=")
    reducer = GradientReducer(spec_or_preset, group=ddp_model.process_group, seed=seed, nonfinite=nonfinite,
                              dense_below=dense_below)
    ddp_model.register_comm_hook(reducer, sparsecomm_hook)
    return reducer
