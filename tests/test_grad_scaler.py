"""Mixed precision's loss scaling under ``nonfinite="propagate"``: where one rank's scaled gradient
overflows, every rank's average is NaN, as DDP's own all_reduce makes it, so every rank's
`GradScaler` skips the step and lowers its scale, and training goes on alike on every rank."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.launch import run_local
from test_training import batches, digest, mlp

OVERFLOW_STEP = 2


class Tagger(torch.nn.Module):
    """A sparse embedding (its gradient a sparse COO tensor) and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embedding = torch.nn.Embedding(100, 16, sparse=True)
            self.classifier = torch.nn.Linear(16, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embedding(tokens).mean(1))


def token_batches(rank: int, world: int, steps: int):
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        yield torch.randint(0, 100, (8, 5), generator=generator), torch.randint(0, 10, (8,), generator=generator)


def scaled_steps(rank: int, world: int, spec: str, model_kind: str = "mlp", overflow: float = float("inf"),
                 device: str = "cpu") -> tuple[list[float], list[bool], str, bool]:
    """Five steps under a GradScaler, rank 1's loss times ``overflow`` at `OVERFLOW_STEP`: each
    step's scale after it, whether the averaged gradients held a non-finite entry, the model's
    digest and whether every rank's state stayed finite. On ``cuda``, under fp16 autocast."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = DDP((mlp(0) if model_kind == "mlp" else Tagger()).to(device))
    reducer = sc.register_ddp_hook(model, spec, nonfinite="propagate")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    scales, overflowed = [], []
    data = batches(rank, world, 5) if model_kind == "mlp" else token_batches(rank, world, 5)
    for step, (inputs, labels) in enumerate(data):
        optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
            loss = F.cross_entropy(model(inputs.to(device)), labels.to(device))
        if step == OVERFLOW_STEP and rank == 1:
            loss = loss * overflow
        scaler.scale(loss).backward()
        overflowed.append(not all(bool(torch.isfinite(p.grad.coalesce().values() if p.grad.is_sparse else p.grad).all())
                                  for p in model.parameters()))
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


@pytest.mark.parametrize(("spec", "model_kind", "overflow"), [
    ("dgc", "mlp", math.inf), ("adaptive", "mlp", math.inf), ("topk(ratio=0.05)+residual+rice+fp32", "mlp", math.inf),
    ("dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+raw+fp32+allgather", "mlp", math.inf),
    # a sparse embedding's rows: taken dense by dgc, sent as rows by top-k
    ("dgc", "tagger", math.inf), ("topk(ratio=0.05)+residual+rice+fp32", "tagger", math.inf),
    # a finite loss whose gradients go beyond what an fp16 value codec carries
    ("topk(ratio=0.05)+residual+rice+fp16+allgather", "mlp", 1e7)])
def test_one_ranks_overflow_makes_every_rank_skip_that_step_and_lower_its_scale(spec, model_kind, overflow):
    (scales, overflowed, first, finite), (other_scales, other_overflowed, second, other_finite) = run_local(
        2, scaled_steps, spec, model_kind, overflow, timeout=120)
    expected = [step == OVERFLOW_STEP for step in range(5)]
    assert overflowed == other_overflowed == expected
    assert scales == other_scales == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert first == second and finite and other_finite


def rows_with_one_rank_empty(rank: int, world: int) -> bool:
    """A sparse gradient of no rows on rank 0 and a NaN row on rank 1: whether this rank's average
    holds a NaN (its GradScaler must find one as every other rank's does)."""
    rows = torch.tensor([[3]]) if rank else torch.zeros(1, 0, dtype=torch.int64)
    values = torch.full((rows.shape[1], 16), math.nan)
    with sc.GradientReducer("topk(ratio=0.05)+residual+rice+fp32", nonfinite="propagate") as reducer:
        gradient = torch.sparse_coo_tensor(rows, values, (100, 16)).coalesce()
        reducer.allreduce_([("emb", gradient)])  # its average, copied into it
        return bool(gradient.coalesce().values().isnan().any())


def test_a_rank_without_rows_finds_the_nan_too():
    assert run_local(2, rows_with_one_rank_empty) == [True, True]


def refused_policy(rank: int, world: int) -> str:
    try:
        sc.GradientReducer("dgc", nonfinite="ignore")
    except sc.SparseCommError as error:
        return str(error)
    return "accepted"


def test_an_unknown_policy_is_refused_naming_propagate():
    assert "propagate" in run_local(1, refused_policy)[0]
