"""The reducer's checkpoint format: what it writes names its format, and a checkpoint in an earlier
format (`sparsecomm.reducer.checkpoint.migrate`) resumes as the run that wrote it went on."""

from pathlib import Path

import pytest
import torch

import sparsecomm as sc
from sparsecomm.adaptive.config import Mode
from sparsecomm.adaptive.planner import Planner
from sparsecomm.components import Adaptive
from sparsecomm.launch import run_local
from sparsecomm.reducer.checkpoint import FORMAT, migrate

GOLDEN = Path(__file__).parent / "golden"
SPEC = "adaptive(budget=3000)+dgc_momentum(masking=false,nesterov=true)+rice+int8+allgather"
FORMAT_0_AFTER = GOLDEN / "reducer_format0_after.pt"
"""the model's parameters after the 4 steps that follow the format-0 checkpoint, as a resumed run
left them (the same on every rank); another machine's matmul kernels round them differently, so
they are compared to 1e-5, not bit for bit"""


def model_of() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"embedding": torch.nn.EmbeddingBag(200, 16, sparse=True),
                                "hidden": torch.nn.Linear(16, 256), "out": torch.nn.Linear(256, 4)})


def step(model: torch.nn.ModuleDict, reducer: sc.GradientReducer, optimizer: torch.optim.Optimizer, rank: int,
         number: int) -> None:
    """One step: an embedding's sparse rows, a compressed matrix and small tensors on the plain route."""
    generator = torch.Generator().manual_seed(1000 * rank + number)
    tokens, labels = torch.randint(200, (16, 6), generator=generator), torch.randint(4, (16,), generator=generator)
    optimizer.zero_grad()
    hidden = torch.relu(model["hidden"](model["embedding"](tokens)))
    torch.nn.functional.cross_entropy(model["out"](hidden), labels).backward()
    reducer.allreduce_((name, p.grad) for name, p in model.named_parameters())
    optimizer.step()


def resumed_from_format_0(rank: int, world: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    saved = torch.load(GOLDEN / f"reducer_format0_rank{rank}.pt", weights_only=True)
    model = model_of()
    model.load_state_dict(saved["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.GradientReducer(SPEC) as reducer:
        reducer.load_state_dict(saved["reducer"])
        for number in range(6, 10):
            step(model, reducer, optimizer, rank, number)
        assert reducer.adaptive is not None
        modes = {str(mode): count for mode, count in reducer.adaptive.planner.mode_steps.items()}
        assert reducer.state_dict()["format"] == FORMAT
    return {name: p.detach().clone() for name, p in model.state_dict().items()}, modes


def test_a_format_0_checkpoint_resumes_as_the_run_that_wrote_it_alike_on_every_rank():
    expected = torch.load(FORMAT_0_AFTER, weights_only=True)
    (first, modes), (second, _) = run_local(2, resumed_from_format_0)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert all(torch.allclose(first[name], expected[name], rtol=0, atol=1e-5) for name in expected)
    assert modes == {"fp32": 1, "sparse": 9}  # its steps counted under the modes' names


def test_a_format_0_planner_keeps_its_trial_its_pairs_and_their_sense():
    budget = {"step": 40, "total_numel": 10, "budget_numel": 8, "compute_s": [0.002], "throughput": [1e9],
              "dense_cost_s": [0.006], "half_cost_s": [0.005], "sparse_overhead_s": [], "bytes_per_nnz": 2.0,
              "fixed_bytes": 0.0, "encode_per_byte": 0.0, "decode_per_byte": 0.0, "max_magnitude": 1.0,
              "last_compute_s": 0.0, "sparse_steps": 0, "reports_read": 38, "mode": "half", "incumbent": "dense",
              "mode_steps": {"dense": 30, "half": 10},
              "trial": {"challenger": "half", "incumbent": "dense", "to_run": ["dense"], "running": {39: ["half", 1.0]},
                        "costs": {37: ["half", 0.005]}, "last_step": 39},
              "last_trial": {"half": 20, "dense": 20}, "rematch": None,
              "pair_ratios": [["dense", "half", [1.2, 1.1]]]}  # fp32's steps over fp16's
    old = {"pipeline": {"spec": "adaptive+residual+rice+int8+allgather", "seed": 0, "tensors": {}}, "calls": {},
           "steps": 40, "uncompressed": {}, "session": {"tunings": [], "expected": []}, "budget": budget,
           "reports": [(38, torch.tensor([0.002, -1e9, 0.006] + [0.0] * 8, dtype=torch.float64))]}
    state = migrate(old)
    assert state["format"] == FORMAT and state["bucket_orders"] == {} and state["row_errors"] == {}
    planner = Planner(Adaptive(), world_size=2)
    planner.load_state_dict(state["adaptive"]["planner"])
    trials = planner.trials
    assert trials.incumbent == Mode.FP32 and planner.current.mode == Mode.FP16
    assert list(trials.pair_ratios[(Mode.FP32, Mode.FP16)]) == [1.2, 1.1]
    assert trials.trial is not None and trials.trial.running == {39: (Mode.FP16, 1.0)}
    assert trials.trial.to_run == [Mode.FP32] and trials.last_trial == {Mode.FP16: 20, Mode.FP32: 20}
    assert list(planner.costs.fp32_step_s) == [0.006] and list(planner.costs.fp16_step_s) == [0.005]
    agreed = state["adaptive"]["reports"]["agreed"]
    assert agreed[0]["step"] == 38 and agreed[0]["report"]["throughput"] == 0.0  # it held a negated throughput


def test_a_checkpoint_of_a_later_format_is_refused_with_its_format():
    with pytest.raises(sc.SparseCommError, match=f"format {FORMAT + 1}"):
        migrate({"format": FORMAT + 1})


def saved_by_two(rank: int, world: int) -> dict:
    with sc.GradientReducer("dgc(ratio=0.01)+residual+raw+fp32+allgather") as reducer:
        reducer.allreduce_([("w", torch.randn(50, 100, generator=torch.Generator().manual_seed(rank)))])
        return reducer.state_dict()


def loaded(rank: int, world: int, state: dict, nonfinite: str) -> str:
    with sc.GradientReducer("dgc(ratio=0.01)+residual+raw+fp32+allgather", nonfinite=nonfinite) as reducer:
        gradient = torch.ones(50, 100)
        reducer.allreduce_([("w", gradient)])  # started: the load is checked at once
        before = reducer.pipeline.states["w"].feedback["residual"].clone()
        try:
            reducer.load_state_dict(state)
        except sc.SparseCommError as err:
            kept = reducer.pipeline.states["w"].feedback["residual"]
            assert torch.equal(kept, before), "a refused load restores nothing"
            return str(err)
        assert torch.equal(reducer.pipeline.states["w"].feedback["residual"], state["pipeline"]["tensors"]["w"]
                           ["feedback"]["residual"]), "a checkpoint that loads restores the residual"
        return "loaded"


def test_a_checkpoint_of_another_world_size_or_policy_is_refused_and_restores_nothing():
    state = run_local(2, saved_by_two)[0]
    assert state["config"] == {"world_size": 2, "nonfinite": "raise", "dense_below": 4096, "average": True}
    assert run_local(2, loaded, state, "raise") == ["loaded"] * 2
    refused = run_local(1, loaded, state, "raise")[0]
    assert "world_size 2 (this reducer: 1)" in refused, refused
    refused = run_local(2, loaded, state, "skip")[0]
    assert "nonfinite 'raise' (this reducer: 'skip')" in refused, refused


def test_a_format_3_checkpoint_records_no_configuration_and_loads_unchecked():
    assert migrate({"format": 3, "adaptive": None})["config"] is None
