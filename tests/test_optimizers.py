"""Pipelines and optimizers: a feedback that applies SGD's momentum itself (DGC's) meets an optimizer
with momentum of its own (SGD with momentum, AdamW) only as error feedback — switched before the
first step, with a warning that says why — so no momentum is applied twice."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.components import DGCMomentum, Residual
from sparsecomm.launch import run_local
from sparsecomm.presets import resolve
from sparsecomm.reducer.optimizers import suited_feedback, suited_spec
from test_training import batches, digest, mlp


def parameters() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(("optimizer", "switches"), [
    (torch.optim.SGD(parameters(), lr=0.1), False),
    (torch.optim.SGD(parameters(), lr=0.1, momentum=0.9), True),
    (torch.optim.AdamW(parameters()), True),
    (torch.optim.Adam(parameters()), True),
])
def test_a_momentum_correcting_feedback_gives_way_to_an_optimizers_own_momentum(optimizer, switches):
    feedback, why = suited_feedback(DGCMomentum(momentum=0.9, nesterov=True), optimizer)
    assert (feedback == Residual()) is switches and (why is not None) is switches
    if switches:
        assert type(optimizer).__name__ in why and "residual" in why
    assert suited_feedback(Residual(), optimizer) == (Residual(), None)  # error feedback suits every optimizer


@pytest.mark.parametrize(("optimizer", "warmup", "least", "rank"), [
    (torch.optim.SGD(parameters(), lr=0.1, momentum=0.9), -1, 0.001, 0),  # linear in the gradient: sparse at once
    (torch.optim.AdamW(parameters()), 20, 0.05, 8),  # normalizes it: a burst would stay in its second moment
    (torch.optim.Adagrad(parameters()), 20, 0.05, 8),
])
def test_adaptive_eases_sparsity_in_holds_less_back_and_goes_low_rank_under_an_optimizer_that_normalizes(
        optimizer, warmup, least, rank):
    sparsifier = suited_spec(resolve("adaptive"), optimizer)[0].sparsifier
    assert (sparsifier.warmup, sparsifier.dense_start, max(sparsifier.low_rank, 0)) == (warmup, 0, rank)
    assert sparsifier.least == least and sparsifier.at_density(1e-6).density == least
    told = suited_spec(resolve("adaptive(warmup=3,floor=0.002,low_rank=0)+residual+rice+int8+allgather"), optimizer)[0]
    assert (told.sparsifier.warmup, told.sparsifier.least, told.sparsifier.low_rank) == (3, 0.002, 0)  # as set


def adamw_training(rank: int, world: int, preset: str) -> dict:
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sc.check_optimizer(optimizer, reducer)
        sc.check_optimizer(optimizer, reducer)  # a second call changes nothing more
    losses = []
    for data, labels in batches(rank, world, 24):  # DGC's warm-up and AdamW's sparse updates start slowly
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), labels)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    horizon = reducer.adaptive.planner.costs.feedback_horizon if reducer.adaptive is not None else None
    planned = reducer.adaptive.planner.sparsifier if reducer.adaptive is not None else None
    easing = (planned.warmup, planned.least) if planned is not None else None
    try:
        sc.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), reducer)
        late = "no error"
    except sc.SparseCommError as err:
        late = str(err)
    reducer.close()
    return {"warnings": [str(w.message) for w in caught], "feedback": reducer.spec.feedback.name,
            "digest": digest(model), "losses": losses, "horizon": horizon, "late": late, "easing": easing}


@pytest.mark.parametrize("preset", ["dgc", "adaptive"])
def test_adamw_trains_with_error_feedback_in_place_of_dgcs_momentum_alike_on_every_rank(preset):
    results = run_local(2, adamw_training, preset)
    for result in results:
        assert result["feedback"] == "residual" and len(result["warnings"]) == 1
        assert "AdamW applies its own" in result["warnings"][0]
        assert sum(result["losses"][-4:]) < sum(result["losses"][:4])
        assert "already reduced gradients" not in result["late"]  # residual suits SGD with momentum too
    assert results[0]["digest"] == results[1]["digest"]
    if preset == "adaptive":
        assert results[0]["horizon"] == 1.0  # error feedback delivers within a step, not a momentum's memory
        assert results[0]["easing"] == (20, 0.05)  # the planner eases sparsity in over 20 steps, to 5%


def loop_under_adamw(rank: int, world: int) -> str:
    weight = torch.ones(8192, requires_grad=True)
    optimizer = torch.optim.AdamW([weight])
    reducer = sc.GradientReducer("dgc")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        sc.check_optimizer(optimizer, reducer)
    for _ in range(2):  # every step names the preset it was built with, as a loop does
        weight.grad = torch.randn(8192)
        reducer = sc.allreduce_gradients([("weight", weight.grad)], "dgc", reducer)
    try:
        sc.allreduce_gradients([("weight", weight.grad)], "dense", reducer)
        other = "no error"
    except sc.SparseCommError as err:
        other = str(err)
    reducer.close()
    return f"{reducer.spec.feedback.name}; {other}"


def test_a_loop_may_name_the_preset_its_reducer_was_built_with_after_the_optimizer_changed_it():
    for result in run_local(2, loop_under_adamw):
        assert result.startswith("residual; ") and "build a new reducer" in result  # another spec is still refused


def switched_late(rank: int, world: int) -> str:
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, "dgc")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for data, labels in batches(rank, world, 2):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
    try:
        sc.check_optimizer(torch.optim.AdamW(model.parameters()), reducer)
    except sc.SparseCommError as err:
        return str(err)
    finally:
        reducer.close()
    return "no error"


def test_suiting_the_optimizer_after_the_first_step_is_refused_on_every_rank():
    assert all("before the first step" in message for message in run_local(2, switched_late))


def test_an_optimizer_sharded_by_zero_is_taken_for_the_one_it_holds():
    """torch's ZeroRedundancyOptimizer keeps its rank's optimizer in ``optim``."""
    from sparsecomm.reducer.optimizers import normalizes

    class Sharding:
        def __init__(self, local: torch.optim.Optimizer) -> None:
            self.optim = local

    assert not normalizes(Sharding(torch.optim.SGD(parameters(), lr=0.1)))
    assert normalizes(Sharding(torch.optim.AdamW(parameters())))
