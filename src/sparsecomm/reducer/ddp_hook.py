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
from sparsecomm.reducer.hierarchical import HierarchicalReducer
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.reducer.topology import Topology
from sparsecomm.spec import PipelineSpec


def ddp_comm_hook(state: GradientReducer | HierarchicalReducer,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook whose state is a `GradientReducer` or `HierarchicalReducer` (built
    with ``model=``).

    DDP calls it once per bucket; it hands the bucket to `GradientReducer.reduce_bucket_async`, and
    on the step's last bucket waits for the step's calls (`GradientReducer.finish_step`), so an
    error any call met is raised here and reaches ``backward()``'s caller on every rank.

    Args:
        state: the reducer, built with ``model=`` the DDP model.
        bucket: DDP's bucket of gradients (flat; a sparse COO tensor for a sparse embedding).

    Returns:
        A future of the bucket averaged over ranks.

    Raises:
        SparseCommError: on the step's last bucket, the first error any of the step's calls met (a
            non-finite gradient under ``nonfinite="raise"``, ranks that disagree, a value a codec
            cannot carry) — on every rank.

    Example:
        ```python ranks=2
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import sparsecomm as sc

        model = DDP(torch.nn.Linear(128, 64))
        reducer = sc.GradientReducer("topk(ratio=0.01)+residual+rice+fp32", model=model)
        model.register_comm_hook(reducer, sc.ddp_comm_hook)
        model(torch.randn(4, 128)).sum().backward()
        print(reducer.stats.summary())
        ```
    """
    future = state.reduce_bucket_async(bucket)
    if bucket.is_last():
        state.finish_step()
    return future


def register_ddp_hook(ddp_model: DistributedDataParallel, spec_or_preset: str | PipelineSpec, seed: int = 0,
                      nonfinite: str = "raise", dense_below: int = DENSE_BELOW,
                      topology: Topology | None = None) -> GradientReducer | HierarchicalReducer:
    """``ddp_model.register_comm_hook(GradientReducer(spec, model=ddp_model, ...), ddp_comm_hook)``,
    in one line; with ``topology``, a `HierarchicalReducer` (dense inside each node, compressed
    between nodes).

    Call it on every rank, before the first backward pass (DDP takes one hook, once).

    Args:
        ddp_model: the `DistributedDataParallel` model; its process group is the reducer's.
        spec_or_preset: a preset name (``"adaptive"``, ``"dgc"``) or a pipeline spec string.
        seed: seeds every random choice; every rank must pass the same.
        nonfinite: ``"raise"``, ``"propagate"`` (fp16 mixed precision's ``GradScaler``), ``"skip"``
            or ``"zero"`` (see `GradientReducer`).
        dense_below: tensors and buckets with fewer elements take a plain fp32 all_reduce.
        topology: ranks per node (`Topology`; ``Topology.from_env()`` under torchrun); None: one
            flat group, every rank a peer.

    Returns:
        The reducer: its ``stats``, and ``state_dict()`` / ``load_state_dict()`` for checkpoints.

    Raises:
        SparseCommError: torch.distributed is not initialised, or the ranks' arguments differ.
        SpecError: the spec is invalid.

    Example:
        ```python ranks=2
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import sparsecomm as sc

        model = DDP(torch.nn.Linear(128, 64))
        reducer = sc.register_ddp_hook(model, "dgc")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 128)).square().mean().backward()
            optimizer.step()
        print(reducer.stats.steps, "steps,", reducer.stats.bytes_sent, "bytes sent")
        ```
    """
    reducer: GradientReducer | HierarchicalReducer
    if topology is None:
        reducer = GradientReducer(spec_or_preset, seed=seed, nonfinite=nonfinite, dense_below=dense_below,
                                  model=ddp_model)
    else:
        reducer = HierarchicalReducer(spec_or_preset, topology, seed=seed, nonfinite=nonfinite,
                                      dense_below=dense_below, model=ddp_model)
    ddp_model.register_comm_hook(reducer, ddp_comm_hook)
    return reducer
