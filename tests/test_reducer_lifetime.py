"""What a reducer holds and hands back: a DDP model with its hook is freed once the user drops it
(so a run can go on with a fresh DDP after a hook's error), an error already handed to a
`reduce_async` future is not raised again by the next step, and `reduce` leaves its input alone."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.launch import run_local
from test_training import CLASSES, FEATURES, mlp

HANG_S = 60


def dropped_ddp_is_freed(rank: int, world: int) -> bool:
    ddp = DDP(mlp(0))
    reducer = sc.register_ddp_hook(ddp, "dgc")
    F.cross_entropy(ddp(torch.randn(8, FEATURES)), torch.randint(CLASSES, (8,))).backward()
    reducer.close()
    dropped = weakref.ref(ddp)
    del ddp, reducer
    gc.collect()
    return dropped() is None


def test_a_ddp_model_and_its_reducer_are_freed_once_dropped():
    assert run_local(2, dropped_ddp_is_freed, timeout=HANG_S) == [True, True]


def handled_error_then_steps(rank: int, world: int) -> list[str]:
    """A side reduction that fails (rank 1's NaN) and is handled, then two steps of training."""
    ddp = DDP(mlp(0))
    reducer = sc.register_ddp_hook(ddp, "topk(ratio=0.1)+residual+rice+fp32")
    outcomes = []
    metric = torch.tensor([float("nan") if rank == 1 else 1.0, 2.0])
    try:
        reducer.reduce_async("metric", metric).wait()
        outcomes.append("summed")
    except sc.SparseCommError:
        outcomes.append("refused")
    for _ in range(2):
        F.cross_entropy(ddp(torch.randn(8, FEATURES)), torch.randint(CLASSES, (8,))).backward()
        outcomes.append("step")
    return outcomes


def test_an_error_handed_to_a_reduce_async_future_is_not_raised_again_by_the_next_step():
    assert run_local(2, handled_error_then_steps, timeout=HANG_S) == [["refused", "step", "step"]] * 2


@pytest.mark.parametrize("spec", ["dense", "topk(ratio=1.0)+residual+rice+fp32",
                                  "adaptive+residual+rice+int8+allgather"])
def test_reduce_leaves_its_input_alone(spec):
    for mine, average in run_local(2, reduced_alone, spec, timeout=HANG_S):
        assert mine != average == pytest.approx(1.5)


def reduced_alone(rank: int, world: int, spec: str) -> tuple[float, float]:
    with sc.GradientReducer(spec) as reducer:
        loss = torch.full((4,), float(rank + 1))
        average = reducer.reduce("loss", loss)
        return float(loss[0]), float(average[0])
