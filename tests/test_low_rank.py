"""``adaptive``'s low-rank steps (PowerSGD, `sparsecomm.reducer.paths.low_rank`): its compressed
steps under an optimizer that normalizes the gradient, weighed against dense ones by trials. Every
rank gets the same average, each matrix's of the step's rank and every vector's exact; what the
average missed stays in the residual, so nothing is lost; a gradient of the step's rank arrives
whole (to bf16's rounding); a checkpoint (each matrix's warm-started Q) resumes bit for bit; a
non-finite gradient fails every rank and loses nothing."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.adaptive.planner import Planner
from sparsecomm.adaptive.report import Report
from sparsecomm.launch import run_local
from sparsecomm.reducer.call import Route
from sparsecomm.reducer.checkpoint import FORMAT, migrate
from sparsecomm.sparsify.adaptive import Adaptive
from test_training import batches, digest, mlp

SPEC = "adaptive(low_rank=2)+residual+rice+int8+allgather"
LOW_RANK_PRESET = "adaptive(low_rank=2)+dgc_momentum(masking=false,nesterov=true)+rice+int8+allgather"
"""the ``adaptive`` preset asking for low-rank steps (`check_optimizer` gives AdamW ``residual``)"""
SHAPES = {"w": (48, 40), "v": (40,), "small": (3, 4)}  # a matrix, a vector, a matrix rank 2 cannot halve


def forced_low_rank(reducer: sc.GradientReducer) -> None:
    reducer.adaptive.planner.plan = lambda: Plan(Mode.LOW_RANK)


def low_rank_steps(rank: int, world: int, steps: int, common: torch.Tensor | None = None) -> dict:
    """``steps`` low-rank steps of random gradients (``common``: every rank's "w" is that matrix):
    what every rank fed in (summed over ranks), was given (the averages, summed over steps), and
    holds (summed over ranks)."""
    generator = torch.Generator().manual_seed(rank)
    fed = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    given = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    averages = []
    with sc.GradientReducer(SPEC) as reducer:
        forced_low_rank(reducer)
        for _ in range(steps):
            grads = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
            if common is not None:
                grads["w"] = common.clone()
            for name, grad in grads.items():
                fed[name] += grad
            reducer.allreduce_(list(grads.items()))
            for name, grad in grads.items():
                given[name] += grad
            averages.append({name: grad.clone() for name, grad in grads.items()})
        held = {name: reducer.pipeline.states[name].feedback.get("residual", torch.zeros(0)).reshape(-1).double()
                for name in SHAPES}
        modes = dict(reducer.adaptive.planner.mode_steps)
    for name in SHAPES:
        dist.all_reduce(fed[name])
        if held[name].numel():
            dist.all_reduce(held[name])
    return {"fed": fed, "given": given, "held": held, "averages": averages, "modes": modes}


def test_a_low_rank_step_gives_every_rank_the_same_average_of_the_steps_rank_and_vectors_exact():
    runs = run_local(2, low_rank_steps, 3)
    assert runs[0]["modes"] == {Mode.LOW_RANK: 3}
    for first, second in zip(runs[0]["averages"], runs[1]["averages"], strict=True):
        assert all(torch.equal(first[name], second[name]) for name in SHAPES)
        assert torch.linalg.matrix_rank(first["w"]) == 2
    # vectors and matrices too small to factor go exactly: the mean of what the ranks fed
    for name in ("v", "small"):
        assert torch.allclose(runs[0]["given"][name] * 2, runs[0]["fed"][name], atol=1e-5)


def test_what_a_low_rank_step_misses_stays_in_the_residual():
    run = run_local(2, low_rank_steps, 4)[0]
    fed, given, held = run["fed"]["w"], run["given"]["w"], run["held"]["w"]
    assert float(held.abs().max()) > 1.0  # rank 2 of a random 48 × 40 matrix misses most of it
    assert torch.allclose(given.reshape(-1) * 2 + held, fed.reshape(-1), atol=1e-4)


def test_a_gradient_of_the_steps_rank_arrives_whole():
    """Every rank feeding the same rank-2 matrix: P spans its columns, and P̂·Q̄ᵀ is the matrix itself
    (P̂ orthonormal) to bf16's rounding of P and Q, every step; only that rounding is left behind."""
    generator = torch.Generator().manual_seed(7)
    common = torch.randn(48, 2, generator=generator) @ torch.randn(2, 40, generator=generator)
    run = run_local(2, low_rank_steps, 3, common)[0]
    errors = [float((step["w"] - common).norm() / common.norm()) for step in run["averages"]]
    assert max(errors) < 2**-7, errors
    assert float(run["held"]["w"].abs().max()) < 2**-6 * float(common.abs().max())


class Named(torch.nn.Module):
    """Parameters in the order of ``names`` (DDP lays its bucket out from that order); the loss
    sum(p · G) makes each gradient G."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        for name in names:
            self.register_parameter(name, torch.nn.Parameter(torch.zeros((80, 64) if name.startswith("w") else (64,))))

    def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, name) * grad).sum() for name, grad in grads.items())


def ordered_low_rank(rank: int, world: int, names: list[str]) -> dict:
    """Two low-rank DDP steps of the same gradients, the bucket's tensors in the order of ``names``."""
    generator = torch.Generator().manual_seed(rank)
    steps = [{name: torch.randn((80, 64) if name.startswith("w") else (64,), generator=generator)
              for name in ("w1", "w2", "w3", "v")} for _ in range(2)]
    model = DDP(Named(names), bucket_cap_mb=1)
    reducer = sc.register_ddp_hook(model, SPEC)
    forced_low_rank(reducer)
    averages = []
    for grads in steps:
        model.zero_grad()
        model(grads).backward()
        averages.append({name: parameter.grad.clone() for name, parameter in model.module.named_parameters()})
    reducer.close()
    return averages


def test_matrices_at_a_regular_stride_or_not_get_the_same_average():
    """A bucket's three 80 × 64 matrices one after another (read in place, at a stride) or, in the
    first step (before DDP orders its bucket by when gradients are ready), with a vector between
    two of them (gathered by an index): the same averages."""
    strided = run_local(2, ordered_low_rank, ["v", "w1", "w2", "w3"])[0]
    gathered = run_local(2, ordered_low_rank, ["w1", "v", "w2", "w3"])[0]
    for one, other in zip(strided, gathered, strict=True):
        for name in one:
            assert torch.allclose(one[name], other[name], atol=1e-6), name
    assert torch.linalg.matrix_rank(strided[0]["w1"]) == 2


def slow_link_modes(rank: int, world: int, optimizer: str, steps: int, resume_at: int | None = None) -> dict:
    """``steps`` of `LOW_RANK_PRESET` on a link faked slow (1 MB/s), under ``optimizer``, DDP
    in several buckets; with ``resume_at``, from a checkpoint taken there into a new reducer."""
    model = DDP(mlp(0), bucket_cap_mb=0.1)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.05))
    reducer = slowed(sc.register_ddp_hook(model, LOW_RANK_PRESET))
    sc.check_optimizer(opt, reducer)
    modes = []
    for step, (data, labels) in enumerate(batches(rank, world, steps)):
        if step == resume_at:
            state = reducer.state_dict()
            reducer.close()
            model = DDP(model.module, bucket_cap_mb=0.1)
            reducer = sc.register_ddp_hook(model, LOW_RANK_PRESET)
            sc.check_optimizer(opt, reducer)
            reducer.load_state_dict(state)
        opt.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        opt.step()
        modes.append(reducer.adaptive.planner.current.mode)
    reducer.close()
    return {"digest": digest(model.module), "modes": modes}


def slowed(reducer):
    for probed in (reducer.adaptive.planner.costs.throughput, reducer.adaptive.planner.costs.fp16_throughput):
        probed.clear()
        probed.append(1e6)
    return reducer


def test_under_adamw_the_steps_go_low_rank_and_under_dgcs_momentum_sparse():
    adamw, sgd = run_local(2, slow_link_modes, "adamw", 6), run_local(2, slow_link_modes, "sgd", 6)
    assert adamw[0] == adamw[1] and sgd[0] == sgd[1]  # every rank the same modes and model
    assert adamw[0]["modes"] == [Mode.LOW_RANK] * 6
    assert Mode.LOW_RANK not in sgd[0]["modes"]


def test_a_run_resumed_from_a_checkpoint_in_its_low_rank_steps_continues_bit_for_bit():
    straight, resumed = run_local(2, slow_link_modes, "adamw", 6), run_local(2, slow_link_modes, "adamw", 6, 3)
    assert resumed[0]["modes"] == [Mode.LOW_RANK] * 6
    assert straight[0]["digest"] == resumed[0]["digest"] == resumed[1]["digest"]


def test_low_rank_steps_last_the_run_unless_a_user_budget_or_sharding_turns_them_off():
    planner = Planner(Adaptive(low_rank=2, warmup=5), 2, low_rank_form=True)
    assert [planner.low_rank_step() for planner.step in (0, 9, 10, 1000)] == [True] * 4
    planner.sparsifier = Adaptive(low_rank=2, warmup=5, budget=1000)
    assert not planner.low_rank_step()
    planner = Planner(Adaptive(low_rank=2, warmup=5), 2, low_rank_form=True)
    planner.sharded = True
    assert not planner.low_rank_step()
    assert not Planner(Adaptive(low_rank=2), 2).low_rank_step()  # no low-rank form: sparse
    with pytest.raises(sc.SparseCommError):
        Adaptive(low_rank=-2)


STEP_FIELD = {Mode.FP32: "fp32_step_s", Mode.FP16: "fp16_step_s", Mode.LOW_RANK: "low_rank_step_s"}


def low_rank_run(throughput: float, cost: dict[Mode, float], steps: int = 48) -> tuple[list[Mode], Planner]:
    """A planner whose compressed steps are low-rank, on a link of ``throughput`` bytes a second
    (timed at start-up), 8 MB a dense step and 0.1 s of compute, whose steps take ``cost[mode]``
    in whole, each report heard two steps later: the modes it ran, and the planner."""
    planner = Planner(Adaptive(low_rank=2, probe=0), 2, low_rank_form=True)
    planner.costs.observe_link(throughput)
    modes, pending = [], []
    for _ in range(steps):
        while pending and pending[0][0] <= planner.step - 2:
            step, report = pending.pop(0)
            planner.observe(report, step)
        chosen = planner.begin_step(now=0.0)
        planner.measuring.total_numel = planner.measuring.budget_numel = 2_000_000
        planner.end_step()
        modes.append(chosen.mode)
        pending.append((planner.step - 1, Report(compute_s=0.1, max_magnitude=1.0,
                                                 **{STEP_FIELD[chosen.mode]: cost[chosen.mode]})))
    return modes, planner


def test_where_the_link_is_slow_the_steps_go_low_rank_and_stay():
    """4 MB/s: a dense step's 8 MB take 2 s, fp16's 1 s; a low-rank step 0.12 s."""
    modes, planner = low_rank_run(4e6, {Mode.FP32: 2.1, Mode.FP16: 1.1, Mode.LOW_RANK: 0.12})
    assert modes[0] == Mode.LOW_RANK  # the link timed, the compute not yet: the cheap step
    assert set(modes[3:]) == {Mode.LOW_RANK} and planner.trials.incumbent == Mode.LOW_RANK


@pytest.mark.parametrize("throughput", [60e6, 125e6])
@pytest.mark.parametrize(("cost", "winner"), [
    ({Mode.FP32: 0.2, Mode.FP16: 0.17, Mode.LOW_RANK: 0.11}, Mode.LOW_RANK),
    ({Mode.FP32: 0.105, Mode.FP16: 0.125, Mode.LOW_RANK: 0.1}, Mode.FP32)])
def test_where_the_link_carries_fp16_the_trials_weigh_low_rank_steps_against_the_dense_modes(throughput, cost, winner):
    """60 MB/s: the link carries 6 MB while a step computes, fp16's 4 MB but not fp32's 8 MB; at
    125 MB/s fp32's too, yet a dense step may cost more than its wire (gloo's sums share the
    processors with the backward). Low-rank steps are tried side by side with the dense ones and
    win only by their margin: at 0.1 s against fp32's 0.105 s the more exact mode stays."""
    modes, planner = low_rank_run(throughput, cost)
    assert Mode.LOW_RANK in modes and ({Mode.FP32, Mode.FP16} & set(modes))  # both were run
    assert planner.trials.incumbent == winner and set(modes[-8:]) == {winner}
    if winner is Mode.FP32:  # a close call: decided by paired steps, not by the steps' typical times
        assert planner.trials.pair_ratios[Mode.FP32, Mode.LOW_RANK]


def test_the_first_low_rank_step_builds_its_layout_and_is_not_timed():
    planner = Planner(Adaptive(low_rank=2, probe=0), 2, low_rank_form=True)
    planner.plan = lambda: Plan(Mode.LOW_RANK)
    planner.step = 10  # past the warm-up
    timed = []
    for _ in range(3):
        planner.begin_step(now=0.0)
        planner.last_compute_s = 0.1
        timed.append(planner.end_step().low_rank_step_s)
    assert timed == [0.0, 0.1, 0.1]


def test_a_format_2_checkpoint_starts_the_low_rank_steps_costs_unmeasured():
    _, planner = low_rank_run(60e6, {Mode.FP32: 0.2, Mode.FP16: 0.17, Mode.LOW_RANK: 0.11})
    state = {"format": 2, "adaptive": {"planner": planner.state_dict(), "reports": {}}}
    del state["adaptive"]["planner"]["costs"]["low_rank_step_s"]
    migrated = migrate(state)
    assert migrated["format"] == FORMAT
    fresh = Planner(Adaptive(low_rank=2), 2, low_rank_form=True)
    fresh.load_state_dict(migrated["adaptive"]["planner"])
    assert not fresh.costs.low_rank_step_s and fresh.costs.fp32_step_s == planner.costs.fp32_step_s
    assert fresh.trials.incumbent == Mode.LOW_RANK


def several_matrices(rank: int, world: int, steps: int, deferred: bool) -> dict:
    """``steps`` low-rank steps of three matrices and a vector, each its own call; ``deferred``:
    every second all_reduce waits for the step's end (as over NCCL) rather than for the next call."""
    generator = torch.Generator().manual_seed(rank)
    shapes = {"w1": (48, 40), "w2": (40, 56), "v": (40,), "w3": (30, 48)}
    averages, early = [], []
    with sc.GradientReducer(SPEC) as reducer:
        forced_low_rank(reducer)
        for step in range(steps):
            grads = [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]
            if step == 1:  # the path exists
                watch(reducer.runtime.paths[Route.LOW_RANK], early, deferred)
            reducer.allreduce_(grads)
            averages.append(torch.cat([grad.reshape(-1) for _, grad in grads]))
    return {"averages": averages, "early": early}


def watch(path, early: list[int], deferred: bool) -> None:
    """``path``'s earlier calls' second all_reduces: counted into ``early`` as each call posts, or
    left to the step's end (``deferred``)."""
    post = path._post_second_rounds

    def counted() -> None:
        early.append(len(path._open))
        post()

    path._post_second_rounds = (lambda: None) if deferred else counted


def test_over_gloo_a_calls_second_all_reduce_goes_at_the_next_calls_post_with_the_same_averages():
    """Each call's Q is posted when the step's next call posts its P (while a DDP backward would
    still compute), the same on every rank; the averages are those of Q posted at the step's end."""
    early = run_local(2, several_matrices, 3, False)
    deferred = run_local(2, several_matrices, 3, True)
    # from the second step on (the path exists), three of the four calls each find the one before open
    assert early[0]["early"] == early[1]["early"] == [0, 1, 1, 1] * 2
    for ours, theirs in zip(early[0]["averages"], deferred[0]["averages"], strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(early[0]["averages"], early[1]["averages"], strict=True):
        assert torch.equal(ours, theirs)


def test_a_non_finite_gradient_in_a_call_whose_q_goes_early_fails_every_rank_and_loses_nothing():
    """The NaN's matrix is followed by another call, so its second all_reduce would go at that
    call's post."""
    runs = run_local(2, nonfinite_low_rank, ("w", "w2"))
    assert all("non-finite" in run["error"] and "'w'" in run["error"] and run["kept"] and run["step"] == 2
               for run in runs), runs


def nonfinite_low_rank(rank: int, world: int, names: tuple[str, ...] = ("w",)) -> dict:
    """Rank 1's "w" holds a NaN at the third step, the step's calls ``names`` in that order (each
    after "w" a 40 × 56 matrix): what each rank raised and "w"'s residual holds."""
    with sc.GradientReducer(SPEC) as reducer:
        forced_low_rank(reducer)
        generator = torch.Generator().manual_seed(rank)
        for step in range(3):
            grads = [(name, torch.randn((48, 40) if name == "w" else (40, 56), generator=generator)) for name in names]
            grad = grads[0][1]
            if step == 2 and rank == 1:
                grad[3, 5] = float("nan")
            before = reducer.pipeline.states["w"].feedback["residual"].clone() if step == 2 else None
            try:
                reducer.allreduce_([(name, each.clone()) for name, each in grads])
            except sc.SparseCommError as err:
                after = reducer.pipeline.states["w"].feedback["residual"]
                # the finite rank keeps its gradient too
                expected = before + grad.reshape(before.shape) if rank == 0 else before
                return {"error": str(err), "kept": torch.allclose(expected, after, atol=1e-5),
                        "step": reducer.pipeline.states["w"].step}
    return {"error": "no error", "kept": False}


def test_a_non_finite_gradient_in_a_low_rank_step_fails_every_rank_and_loses_nothing():
    runs = run_local(2, nonfinite_low_rank)
    assert all("non-finite" in run["error"] and run["kept"] and run["step"] == 2 for run in runs), runs


def empty_matrix_low_rank(rank: int, world: int) -> list[float]:
    with sc.GradientReducer(SPEC) as reducer:
        forced_low_rank(reducer)
        grads = [("empty", torch.zeros(0, 7)), ("w", torch.full((48, 40), float(rank)))]
        reducer.allreduce_(grads)
        return [float(grads[1][1].mean()), reducer.adaptive.planner.step]


def test_an_empty_matrix_goes_exactly_in_a_low_rank_step():
    for mean, step in run_local(2, empty_matrix_low_rank):
        assert mean == pytest.approx(0.5, abs=0.01) and step == 1  # the step ran, the matrix beside it low-rank


def half_precision_low_rank(rank: int, world: int, dtype: torch.dtype, steps: int) -> tuple[str, float]:
    """Low-rank steps on a matrix's half-precision gradient with a small steady part: what the ranks
    were given plus what they hold is what they were fed."""
    generator = torch.Generator().manual_seed(rank)
    fed, given = torch.zeros(48, 40, dtype=torch.float64), torch.zeros(48, 40, dtype=torch.float64)
    with sc.GradientReducer("adaptive(low_rank=2)+residual+rice+int8+allgather") as reducer:
        reducer.adaptive.planner.plan = lambda: Plan(Mode.LOW_RANK)
        for _ in range(steps):
            grad = (torch.randn(48, 40, generator=generator) + 3e-4).to(dtype)
            vector = torch.randn(40, generator=generator).to(dtype)
            fed += grad.double()
            reducer.allreduce_([("w", grad), ("v", vector)])
            given += grad.double()
        held = reducer.pipeline.states["w"].feedback["residual"]
        kept = str(held.dtype)
        held = held.reshape(48, 40).double()
    dist.all_reduce(fed)
    dist.all_reduce(held)
    return kept, float((given * world + held - fed).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_gradients_low_rank_steps_keep_their_rounding_in_an_fp32_residual(dtype):
    for kept, gap in run_local(2, half_precision_low_rank, dtype, 20):
        assert kept == "torch.float32" and gap < 1e-4, (kept, gap)  # in bf16's own residual: 0.2
