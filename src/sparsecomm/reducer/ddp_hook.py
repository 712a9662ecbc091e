"""The DDP communication hook, in PyTorch's idiom::

    reducer = sparsecomm.GradientReducer("dgc", model=ddp_model)
    ddp_model.register_comm_hook(reducer, sparsecomm.ddp_comm_hook)

DDP hands the hook one bucket at a time (a flat tensor of gradients, not yet divided by the world
size; a sparse COO tensor for ``Embedding(sparse=True)``) and waits on the returned future for the
averaged bucket. The reducer cuts each bucket into its parameters and keeps their state by name,
so DDP's bucket rebuild after the first iteration, or a fresh DDP after a resume, moves no state
onto another parameter. Inside ``no_sync()`` DDP does not call the hook: the gradients accumulate
and the next synchronised step sends their sum.

DDP turns an exception carried by a hook's future into a ``RuntimeError`` about a failed cast, but
passes on one raised by the hook itself: so the last bucket's call waits for the step's
collectives and raises their first error there — a `SparseCommError` reaches ``backward()``'s
caller as one. (DDP waits for every bucket right after the last one anyway.)
"""

# No "from __future__ import annotations" here: DDP checks that the hook's ``bucket`` annotation *is*
# dist.GradBucket, which a postponed (string) annotation is not.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sparsecomm.reducer.config import DENSE_BELOW
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.spec import PipelineSpec


def ddp_comm_hook(state: GradientReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook whose state is a `GradientReducer` (built with ``model=``)."""
    future = state.reduce_bucket_async(bucket)
    if bucket.is_last():
        state.finish_step()
    return future


def register_ddp_hook(ddp_model: DistributedDataParallel, spec_or_preset: str | PipelineSpec, seed: int = 0,
                      nonfinite: str = "raise", dense_below: int = DENSE_BELOW) -> GradientReducer:
    """``ddp_model.register_comm_hook(GradientReducer(spec, model=ddp_model, ...), ddp_comm_hook)``;
    returns the reducer (statistics, ``state_dict()`` / ``load_state_dict()`` for checkpoints)."""
    reducer = GradientReducer(spec_or_preset, seed=seed, nonfinite=nonfinite, dense_below=dense_below,
                              model=ddp_model)
    ddp_model.register_comm_hook(reducer, ddp_comm_hook)
    return reducer
