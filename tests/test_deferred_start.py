"""A reducer built before torch.distributed is initialised — as a trainer's strategy takes it
(Lightning's ``DDPStrategy(ddp_comm_state=...)``) — starts at its first bucket and then reduces
exactly as one built after; a checkpoint loaded before it starts resumes bit for bit."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.launch import run_local

SPEC = "topk(ratio=0.05)+residual+rice+fp32"


def built_before_init(model: torch.nn.Module, spec: str = SPEC) -> sc.GradientReducer:
    """A reducer built as if torch.distributed were not yet initialised."""
    with mock.patch.object(dist, "is_initialized", return_value=False):
        return sc.GradientReducer(spec, model=model)


def twins(seed: int = 0) -> list[torch.nn.Linear]:
    torch.manual_seed(seed)
    first = torch.nn.Linear(256, 64)
    second = torch.nn.Linear(256, 64)
    second.load_state_dict(first.state_dict())
    return [first, second]


def step(models: list[DDP], rank: int, number: int) -> list[torch.Tensor]:
    data = torch.randn(8, 256, generator=torch.Generator().manual_seed(100 * number + rank))
    for model in models:
        model.zero_grad()
        model(data).square().mean().backward()
    return [model.module.weight.grad.clone() for model in models]


def deferred_start(rank: int, world: int) -> None:
    modules = twins()
    early = built_before_init(modules[0])
    assert not early.started and "not started" in repr(early)
    with pytest.raises(sc.SparseCommError, match="not started"):
        early.state_dict()
    models = [DDP(module) for module in modules]
    late = sc.GradientReducer(SPEC, model=models[1])
    models[0].register_comm_hook(early, sc.ddp_comm_hook)
    models[1].register_comm_hook(late, sc.ddp_comm_hook)
    for number in range(3):
        deferred, direct = step(models, rank, number)
        assert torch.equal(deferred, direct)
    assert early.started and early.config.world_size == world and early.stats.steps == 3

    saved = late.state_dict()
    copy = twins()[0]
    copy.load_state_dict(modules[1].state_dict())
    resumed = built_before_init(copy)
    resumed.load_state_dict(saved)  # before it starts: kept, and restored when it does
    assert resumed.stats.steps == 3 and resumed.state_dict() is saved
    again = DDP(copy)
    again.register_comm_hook(resumed, sc.ddp_comm_hook)
    for number in range(3, 5):
        resumed_grad, direct = step([again, models[1]], rank, number)
        assert torch.equal(resumed_grad, direct)
    assert resumed.stats.steps == late.stats.steps == 5
    for reducer in (early, late, resumed):
        reducer.close()


def test_a_reducer_built_before_init_starts_at_its_first_bucket():
    run_local(2, deferred_start)


def test_a_reducer_not_started_suits_an_optimizer_and_releases_nothing():
    model = torch.nn.Linear(4, 2)
    reducer = built_before_init(model, "dgc")
    with pytest.warns(UserWarning, match="residual instead"):
        sc.check_optimizer(torch.optim.AdamW(model.parameters()), reducer)
    assert "+residual+" in repr(reducer) and not reducer.started  # the ranks agree on it when it starts
    reducer.close()  # nothing started: nothing to release


def foreign_checkpoint(rank: int, world: int) -> None:
    modules = twins()
    models = [DDP(module) for module in modules]
    ours = sc.GradientReducer(SPEC, model=models[0])
    theirs = sc.GradientReducer("topk(ratio=0.1)+residual+rice+fp32", model=models[1])
    models[0].register_comm_hook(ours, sc.ddp_comm_hook)
    models[1].register_comm_hook(theirs, sc.ddp_comm_hook)
    for number in range(2):
        step(models[:1], rank, number)
    for number in range(5):
        step(models[1:], rank, number)
    before = ours.state_dict()
    with pytest.raises(sc.SparseCommError, match="state is for"):
        ours.load_state_dict(theirs.state_dict())
    after = ours.state_dict()  # nothing restored: not the call counts either
    assert after["calls"] == before["calls"] and after["steps"] == before["steps"] == 2

    # loaded before it starts: refused when it does, with nothing of it kept
    copy = twins()[0]
    early = built_before_init(copy)
    early.load_state_dict(theirs.state_dict())
    model = DDP(copy)
    model.register_comm_hook(early, sc.ddp_comm_hook)
    with pytest.raises(sc.SparseCommError, match="state is for"):
        step([model], rank, 0)
    assert early.stats.steps == 0 and early.state_dict()["calls"] == {}
    for reducer in (ours, theirs, early):
        reducer.close()


def test_a_checkpoint_of_another_spec_restores_nothing_loaded_before_or_after_the_start():
    run_local(2, foreign_checkpoint)
