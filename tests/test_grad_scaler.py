"""Mixed precision's loss scaling under ``nonfinite="propagate"``: where one rank's scaled gradient
overflows, every rank's average is NaN, as DDP's own all_reduce makes it, so every rank's
`GradScaler` skips the step and lowers its scale, and training goes on alike on every rank."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.launch import run_local
from test_training import batches, digest, mlp

OVERFLOW_STEP = 2


def scaled_steps(rank: int, world: int, spec: str) -> tuple[list[float], list[bool], str, bool]:
    """Five steps under a GradScaler, rank 1's loss overflowing at `OVERFLOW_STEP`: each step's
    scale after it, whether the averaged gradients held a non-finite entry, the model's digest and
    whether every rank's state stayed finite."""
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, spec, nonfinite="propagate")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales, overflowed = [], []
    for step, (data, labels) in enumerate(batches(rank, world, 5)):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), labels)
        if step == OVERFLOW_STEP and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        overflowed.append(not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    state = reducer.state_dict()
    reducer.close()
    finite = all(bool(torch.isfinite(value).all()) for value in tensors(state))
    return scales, overflowed, digest(model.module), finite


def tensors(state):
    """Every floating-point tensor in a nested checkpoint."""
    if isinstance(state, torch.Tensor):
        return [state] if state.is_floating_point() else []
    if isinstance(state, dict):
        return [tensor for value in state.values() for tensor in tensors(value)]
    if isinstance(state, (list, tuple)):
        return [tensor for value in state for tensor in tensors(value)]
    return []


@pytest.mark.parametrize("spec", ["dgc", "adaptive", "topk(ratio=0.05)+residual+rice+fp32",
                                  "dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+raw+fp32+allgather"])
def test_one_ranks_overflow_makes_every_rank_skip_that_step_and_lower_its_scale(spec):
    (scales, overflowed, first, finite), (other_scales, other_overflowed, second, other_finite) = run_local(
        2, scaled_steps, spec, timeout=120)
    expected = [step == OVERFLOW_STEP for step in range(5)]
    assert overflowed == other_overflowed == expected
    assert scales == other_scales == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert first == second and finite and other_finite


def refused_policy(rank: int, world: int) -> str:
    try:
        sc.GradientReducer("dgc", nonfinite="ignore")
    except sc.SparseCommError as error:
        return str(error)
    return "accepted"


def test_an_unknown_policy_is_refused_naming_propagate():
    assert "propagate" in run_local(1, refused_policy)[0]
