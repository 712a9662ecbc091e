"""A step whose dense or low-rank all_reduce is posted on the caller's thread while a sparse
gradient's rows travel on the reducer's worker thread (an exact transport other than allgather
sends them at once) must post its all_reduce after the rows' collectives, on every rank alike:
gloo matches collectives by order, and ranks that post them in different orders hang or abort."""

import time

import pytest
import torch

import sparsecomm as sc
from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.launch import run_local
from sparsecomm.transport.sparse_allreduce import SparseAllreduce

HANG_S = 60


def steps_with_rows_first(rank: int, world: int, spec: str, mode: Mode) -> tuple[list[str], list[float]]:
    """A sparse embedding (its rows reduced first, on the worker thread; rank 0's transport slowed so
    that its rows are still in flight when the dense part is posted) and a linear layer."""
    if rank == 0:
        reduce = SparseAllreduce.reduce

        def slowed(self, *args, **kwargs):
            time.sleep(0.05)
            return reduce(self, *args, **kwargs)

        SparseAllreduce.reduce = slowed
    try:
        model = torch.nn.Sequential(torch.nn.EmbeddingBag(500, 8, sparse=True), torch.nn.Linear(8, 600))
        with torch.no_grad():
            for index, parameter in enumerate(model.parameters()):
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(index)))
        modes = []
        with sc.GradientReducer(spec, dense_below=1) as reducer:
            reducer.adaptive.planner.plan = lambda: Plan(mode)
            for step in range(4):
                tokens = torch.randint(500, (16, 4), generator=torch.Generator().manual_seed(10 * step + rank))
                model.zero_grad()
                model(tokens).square().mean().backward()
                reducer.allreduce_((name, parameter.grad) for name, parameter in model.named_parameters())
                modes.append(reducer.adaptive.planner.current.mode.value)
        return modes, [float(parameter.grad.to_dense().sum()) for parameter in model.parameters()]
    finally:
        if rank == 0:
            SparseAllreduce.reduce = reduce


@pytest.mark.parametrize(("spec", "mode"), [
    ("adaptive+dgc_momentum(masking=false,nesterov=true)+rice+fp32+sparse_allreduce", Mode.FP32),
    ("adaptive(low_rank=2)+residual+rice+fp32+sparse_allreduce", Mode.LOW_RANK),
], ids=["dense steps", "low-rank steps"])
def test_a_steps_own_all_reduce_follows_the_rows_on_the_worker_thread(spec, mode):
    (modes, sums), (other_modes, other_sums) = run_local(2, steps_with_rows_first, spec, mode, timeout=HANG_S)
    assert modes == other_modes == [mode.value] * 4
    assert sums == other_sums  # every rank applied the same sums
