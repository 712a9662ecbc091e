"""The adaptive pipeline across ranks: every mode (dense fp32, fp16, sparse) gives every rank the same
sum, a dense step is the optimizer's own update, modes switch without losing anything, a non-finite
gradient fails every rank, and with a measured budget every rank plans the same steps."""

import statistics
import threading
from collections import deque

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from helpers import adaptive_at_once
from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.launch import run_local
from test_training import batches, digest, mlp

FP32, FP16, SPARSE = Mode.FP32, Mode.FP16, Mode.SPARSE

CORRECTED = "dgc_momentum(masking=false,nesterov=true)+rice+int8+allgather"
AT_ONCE = adaptive_at_once()
MODEL_BYTES = 4 * sum(p.numel() for p in mlp(0).parameters())


def train(rank: int, world: int, spec: str, steps: int, bucket_cap_mb: float | None = None) -> dict:
    """``steps`` of DDP with the spec's reducer (plain SGD: the pipeline applies momentum), or with
    spec None DDP's own allreduce and SGD with Nesterov momentum."""
    model = DDP(mlp(0), **({"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb else {}))
    reducer = sc.register_ddp_hook(model, spec) if spec else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if spec else 0.9, nesterov=not spec)
    modes = []
    for data, labels in batches(rank, world, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
        modes.append(reducer.adaptive.planner.current.mode if reducer else FP32)
    parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if reducer:
        reducer.close()
    return {"digest": digest(model), "modes": modes, "parameters": parameters}


def test_dense_steps_are_nesterov_sgd_on_the_average_and_identical_on_every_rank():
    ours = run_local(2, train, f"adaptive(budget={MODEL_BYTES})+{CORRECTED}", 8)
    plain = run_local(2, train, None, 8)
    assert ours[0]["modes"] == [FP32] * 8 and ours[0]["digest"] == ours[1]["digest"]
    assert torch.allclose(ours[0]["parameters"], plain[0]["parameters"], rtol=1e-5, atol=1e-6)


def momentum_threads(rank: int, world: int, steps: int) -> set[str]:
    """The threads that applied DGC's momentum to a dense step's average, over ``steps`` DDP steps
    of several buckets."""
    from sparsecomm.reducer.paths import dense_step

    threads = set()
    update_flushed = dense_step.update_flushed

    def recorded(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return update_flushed(*args, **kwargs)

    dense_step.update_flushed = recorded  # this worker process's module only
    train(rank, world, f"adaptive(budget={MODEL_BYTES})+{CORRECTED}", steps, 0.1)
    return threads


def test_a_dense_steps_sum_is_finished_on_the_thread_that_waits_for_the_step():
    """DDP's buckets: the sums are finished when the last bucket's call finishes the step, on the
    backward's thread, while gloo's threads carry the collectives still in flight."""
    assert run_local(2, momentum_threads, 3) == [{threading.main_thread().name}] * 2


def test_fp16_steps_stay_within_fp16s_rounding_of_dense_and_identical_on_every_rank():
    half = run_local(2, train, f"adaptive(budget={MODEL_BYTES // 2})+{CORRECTED}", 8)
    dense = run_local(2, train, f"adaptive(budget={MODEL_BYTES})+{CORRECTED}", 8)
    assert half[0]["modes"][1:] == [FP16] * 7  # the first step's magnitudes are not known yet
    assert half[0]["digest"] == half[1]["digest"]
    drift = (half[0]["parameters"] - dense[0]["parameters"]).abs().max()
    assert 0 < float(drift) < 1e-3


def test_sparse_steps_give_every_rank_the_same_model():
    runs = run_local(2, train, f"adaptive(budget=20000)+{CORRECTED}", 8)
    # from the first step: a budget below fp16's bytes never sends the whole gradient
    assert runs[0]["modes"] == [SPARSE] * 8 and runs[0]["digest"] == runs[1]["digest"]


def test_switching_between_dense_fp16_and_sparse_loses_nothing():
    """Modes forced in turn, rank 0 feeding gradients and rank 1 zeros (so the average is rank 0's
    share alone): everything rank 0 fed in was either delivered or is still in its residual."""
    fed, delivered, held = run_local(2, switching)[0]
    assert torch.allclose(fed, delivered + held, atol=1e-5), float((fed - delivered - held).abs().max())
    assert float(held.abs().max()) > 0  # sparse and fp16 steps did hold something back


def switching(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    numel = 50_000
    fed, delivered = torch.zeros(numel), torch.zeros(numel)
    with sc.GradientReducer("adaptive+residual+rice+int8+allgather") as reducer:
        for step, mode in enumerate([FP32, SPARSE, SPARSE, FP16, SPARSE, FP32, FP16, SPARSE]):
            reducer.adaptive.planner.plan = lambda mode=mode: Plan(mode, 0.01)  # this step's mode, forced
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(step)) * (rank == 0)
            fed += grad
            tensor = grad.clone()
            reducer.allreduce_([("w", tensor)])
            delivered += tensor * world  # the average over ranks, times their number: rank 0's share
        held = reducer.pipeline.states["w"].feedback["residual"].clone()
    return fed, delivered, held


def test_sparse_rows_go_exactly_on_dense_steps_with_what_int8_steps_held_back():
    """Sparse COO rows: sparse steps send them in int8 and hold each entry's rounding error; dense
    and fp16 steps send them exactly through sparsecomm's own exchange (not gloo's sparse
    all_reduce), the held errors with them. Rank 0 feeds rows, rank 1 nothing: what rank 0 fed in
    was delivered or is held, and a dense step leaves nothing held on the rows it sent."""
    fed, delivered, held, held_after_dense = run_local(2, switching_rows)[0]
    assert torch.allclose(fed, delivered + held, atol=1e-6), float((fed - delivered - held).abs().max())
    assert float(held.abs().max()) > 0  # the last (sparse) step rounded
    assert all(float(errors[rows].abs().max()) == 0 and float(errors.abs().max()) > 0
               for errors, rows in held_after_dense)  # rows not sent keep theirs


def switching_rows(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple]]:
    shape = (300, 8)
    fed, delivered, held_after_dense = torch.zeros(shape), torch.zeros(shape), []
    with sc.GradientReducer("adaptive+residual+rice+int8+allgather") as reducer:
        for step, mode in enumerate([SPARSE, SPARSE, FP32, SPARSE, FP16, SPARSE]):
            reducer.adaptive.planner.plan = lambda mode=mode: Plan(mode, 0.01)  # this step's mode, forced
            generator = torch.Generator().manual_seed(step)
            rows = torch.randint(300, (40,), generator=generator)
            values = torch.randn(40, 8, generator=generator) * (rank == 0)
            grad = torch.sparse_coo_tensor(rows[None], values, shape)
            fed += grad.to_dense()
            reducer.allreduce_([("embedding", grad)])
            delivered += grad.to_dense() * world  # the average over ranks, times their number: rank 0's share
            if mode != SPARSE:
                held_after_dense.append((reducer.state_dict()["row_errors"]["embedding"].view(shape).clone(), rows))
        held = reducer.state_dict()["row_errors"]["embedding"].view(shape).clone()
    return fed, delivered, held, held_after_dense


NUMEL = 20_000
BUDGETS = {FP32: 10 * 4 * NUMEL, FP16: 3 * NUMEL, SPARSE: 5000}
"""per mode, a user budget whose steps of one ``NUMEL``-element tensor at 2 ranks run in it (fp16
once the largest magnitude sent is known: an fp32 all_reduce puts 4·NUMEL bytes on each link)"""


@pytest.mark.parametrize("feedback, unchanged_in", [("residual", (FP32,)),
                                                    ("dgc_momentum(masking=false,nesterov=true)", (FP32, FP16))])
def test_a_non_finite_gradient_fails_every_rank_in_every_mode(feedback, unchanged_in):
    """The rank with the NaN keeps its feedback as it was — but for a sparse step's DGC momentum,
    which takes the step of a zero gradient, as the finite rank's took its own; on dense steps
    whose flush only reads the feedback's state (the NaN then goes unscreened and makes every
    rank's sum NaN), every rank does."""
    for mode, budget in BUDGETS.items():
        runs = run_local(2, nonfinite_in_step_three, f"adaptive(budget={budget})+{feedback}+rice+int8+allgather")
        assert all(run["mode"] == mode and "non-finite" in run["error"] for run in runs), (mode, runs)
        assert runs[1]["unchanged"] or (mode == SPARSE and runs[1]["momentum_decayed"]), mode
        if mode in unchanged_in:
            assert runs[0]["unchanged"], mode


def nonfinite_in_step_three(rank: int, world: int, spec: str) -> dict:
    """The error step 3 raised, its mode, and whether the feedback's tensors are as before it."""
    with sc.GradientReducer(spec) as reducer:
        for step in range(4):
            grad = torch.randn(NUMEL)
            if step == 3 and rank == 1:
                grad[17] = float("nan")
            before = {name: value.clone() for name, value in reducer.pipeline.states["w"].feedback.items()
                      if isinstance(value, torch.Tensor)} if step == 3 else {}
            try:
                reducer.allreduce_([("w", grad)])
            except sc.SparseCommError as err:
                after = reducer.pipeline.states["w"].feedback
                decayed = "momentum_buffer" in before and torch.allclose(
                    after["momentum_buffer"].reshape(-1), 0.9 * before["momentum_buffer"].reshape(-1))
                return {"error": str(err), "mode": reducer.adaptive.planner.current.mode,
                        "unchanged": all(torch.equal(value, after[name]) for name, value in before.items()),
                        "momentum_decayed": decayed}
    return {"error": "no error", "mode": reducer.adaptive.planner.current.mode, "unchanged": False}


def test_a_measured_budget_plans_alike_on_every_rank_through_several_buckets():
    runs = run_local(2, train, AT_ONCE, 24, 0.1)  # ~100 kB buckets: four of them
    assert runs[0]["modes"] == runs[1]["modes"] and runs[0]["digest"] == runs[1]["digest"]
    assert runs[0]["modes"][0] == SPARSE  # the link was timed at start-up: the first step is the cheap one


class HeldLink(deque):
    """A throughput window that keeps what it was built with: the steps' own measurements of the
    loopback under the test are dropped, so the link stays as slow as the test says."""

    def append(self, value: float) -> None:
        pass


def on_a_slow_link(rank: int, world: int, steps: int, device: str = "cpu") -> dict:
    """``steps`` of the adaptive preset on a link held at 1 MB/s in fp32 and fp16: every step is
    sparse, after the first exploring ones at the density the gradients preferred (a dense step
    would be predicted to cost a hundred sparse ones). On ``device``."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = DDP(mlp(0).to(device), bucket_cap_mb=0.1)
    reducer = sc.register_ddp_hook(model, AT_ONCE)
    costs = reducer.adaptive.planner.costs
    costs.throughput, costs.fp16_throughput = HeldLink([1e6]), HeldLink([1e6])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    plans = []
    for data, labels in batches(rank, world, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(data.to(device)), labels.to(device)).backward()
        optimizer.step()
        plans.append(reducer.adaptive.planner.current)
    preferred = list(reducer.adaptive.planner.costs.preferred_density)
    reducer.close()
    return {"digest": digest(model.module.cpu()), "plans": plans, "preferred": preferred}


def test_on_a_slow_link_sparse_steps_run_at_the_density_every_ranks_gradient_agreed_on():
    runs = run_local(2, on_a_slow_link, 40)
    assert runs[0]["plans"] == runs[1]["plans"] and runs[0]["digest"] == runs[1]["digest"]
    routes = {SPARSE, Mode.DEVICE}  # every step sparse, on either route (the trials try the device route too)
    assert {plan.mode for plan in runs[0]["plans"]} <= routes and SPARSE in {plan.mode for plan in runs[0]["plans"]}
    preferred = runs[0]["preferred"]
    assert preferred == runs[1]["preferred"] and len(preferred) >= 5  # one every 4th sparse step, agreed
    assert all(0.001 <= density <= 0.25 for density in preferred)
    last = runs[0]["plans"][-1]
    assert last.mode in routes and last.density == pytest.approx(statistics.median(preferred))


def probed_link(rank: int, world: int) -> tuple[list[float], list[float]]:
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, "adaptive")
    probe = list(reducer.adaptive.planner.costs.throughput), list(reducer.adaptive.planner.costs.fp16_throughput)
    reducer.close()
    return probe


def test_the_link_is_probed_at_start_up_in_fp32_and_fp16_with_the_same_numbers_on_every_rank():
    """fp16's own throughput predicts its steps until they are timed (gloo sums fp16 on the
    processor: half the bytes need not take half the time)."""
    runs = run_local(2, probed_link)
    assert runs[0] == runs[1]
    (fp32,), (fp16,) = runs[0]
    assert fp32 > 0 and fp16 > 0


def groups_made_while_training(rank: int, world: int, spec: str) -> int:
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    made, new_group = [], torch.distributed.new_group

    def counting(*args, **kwargs):
        made.append(args)
        return new_group(*args, **kwargs)

    torch.distributed.new_group = counting
    try:
        for data, labels in batches(rank, world, 3):
            optimizer.zero_grad()
            F.cross_entropy(model(data), labels).backward()
            optimizer.step()
    finally:
        torch.distributed.new_group = new_group
    reducer.close()
    return len(made)


def test_every_process_group_is_made_before_the_first_step():
    """A new gloo group's rendezvous took ~11 ms of the first sparse step (the payload exchange's
    one-way group): a step's time is the training's, and the budget's measurements."""
    assert run_local(2, groups_made_while_training, f"adaptive(budget=20000)+{CORRECTED}") == [0, 0]


def embedding_steps(rank: int, world: int, spec: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(500, 8, sparse=True), torch.nn.Linear(8, 2))
    modes = []
    with sc.GradientReducer(spec, dense_below=1) as reducer:  # the small linear layer under the budget too
        for step in range(6):
            tokens = torch.randint(500, (16, 4), generator=torch.Generator().manual_seed(step * 10 + rank))
            model.zero_grad()
            model(tokens).square().mean().backward()
            reducer.allreduce_((name, p.grad) for name, p in model.named_parameters())
            for p in model.parameters():
                p.data.add_(p.grad.to_dense() if p.grad.is_sparse else p.grad, alpha=-0.1)
            modes.append(reducer.adaptive.planner.current.mode)
    return {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "modes": modes}


@pytest.mark.parametrize("budget", [10**8, 200])
def test_sparse_embedding_rows_travel_in_dense_and_sparse_steps(budget):
    runs = run_local(2, embedding_steps, f"adaptive(budget={budget})+residual+rice+int8+allgather")
    assert torch.equal(runs[0]["weights"], runs[1]["weights"])
    assert runs[0]["modes"][-1] == (FP32 if budget > 1000 else SPARSE)


def ddp_embedding_steps(rank: int, world: int, budget: int) -> dict:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.EmbeddingBag(500, 8, sparse=True), torch.nn.Linear(8, 600)))
    reducer = sc.GradientReducer(f"adaptive(budget={budget})+{CORRECTED}", model=model, dense_below=1)
    model.register_comm_hook(reducer, sc.ddp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    modes = []
    for step in range(6):
        tokens = torch.randint(500, (16, 4), generator=torch.Generator().manual_seed(step * 10 + rank))
        optimizer.zero_grad()
        model(tokens).square().mean().backward()
        optimizer.step()
        modes.append(reducer.adaptive.planner.current.mode)
    reducer.close()
    return {"digest": digest(model), "modes": modes}


@pytest.mark.parametrize(("budget", "mode"), [(10**8, FP32), (30_000, FP16), (500, SPARSE)])
def test_ddp_buckets_of_sparse_embedding_rows_travel_in_every_mode(budget, mode):
    runs = run_local(2, ddp_embedding_steps, budget)
    assert runs[0]["digest"] == runs[1]["digest"]
    assert runs[0]["modes"][-1] == mode
