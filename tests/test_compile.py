"""``torch.compile`` of a DDP model with the hook: the compiled graph's backward hands DDP the same
buckets, so a lossless pipeline gives exactly DDP's own sums and a compressed one trains with the
ranks alike."""

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.launch import run_local


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 64, generator=generator), torch.randint(10, (16,), generator=generator)


def compiled_gradients(rank: int, world: int, spec: str | None, steps: int) -> list[torch.Tensor]:
    """Each parameter's gradient after ``steps`` SGD steps of a compiled DDP model (None: no hook),
    and the last loss."""
    model = DDP(mlp())
    reducer = sc.register_ddp_hook(model, spec, dense_below=0) if spec else None
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        data, labels = batch(rank, step)
        optimizer.zero_grad()
        loss = F.cross_entropy(compiled(data), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if reducer is not None:
        assert reducer.stats.steps == steps
        reducer.close()
    return [p.grad.clone() for p in model.parameters()] + [torch.tensor(losses)]


def test_a_compiled_ddp_model_with_a_lossless_hook_sums_exactly_as_ddp():
    plain = run_local(2, compiled_gradients, None, 3)
    hooked = run_local(2, compiled_gradients, "dense", 3)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(plain[rank], hooked[rank], strict=True))


def test_a_compiled_ddp_model_trains_through_a_compressed_hook_with_the_ranks_alike():
    first, second = run_local(2, compiled_gradients, "topk(ratio=0.05)+residual+rice+fp32", 30)
    assert all(torch.equal(a, b) for a, b in zip(first[:-1], second[:-1], strict=True))
    losses = first[-1]
    assert losses[-5:].mean() < losses[:5].mean()
