"""End to end: real models trained by 2-3 gloo workers through the DDP hook and through
`allreduce_gradients`, dense and sparse (embedding) gradients, checkpoints, and bad input."""

import hashlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.launch import run_local

CLASSES, FEATURES = 10, 32


def dataset(seed: int = 0, samples: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gaussian-mixture classification task (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=generator) * 0.5
    labels = torch.randint(CLASSES, (samples,), generator=generator)
    return centers[labels] + torch.randn(samples, FEATURES, generator=generator), labels


def mlp(seed: int) -> nn.Module:
    with torch.random.fork_rng():  # the test's model init only; the library never touches this RNG
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, CLASSES))


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()


def batches(rank: int, world: int, steps: int, batch: int = 32):
    data, labels = dataset()
    shard = torch.arange(rank, len(labels), world)
    for step in range(steps):
        chosen = shard[(step * batch + torch.arange(batch)) % len(shard)]
        yield data[chosen], labels[chosen]


def full_loss(model: nn.Module) -> float:
    data, labels = dataset()
    with torch.no_grad():
        return float(F.cross_entropy(model(data), labels))


def train_ddp(rank: int, world: int, spec: str, steps: int, momentum: float) -> dict:
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, spec, seed=1, dense_below=1024)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    for data, labels in batches(rank, world, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
    return {"loss": full_loss(model), "digest": digest(model), "stats": reducer.stats.summary()}


def test_ddp_with_the_dgc_preset_keeps_ranks_identical_and_tracks_dense_loss():
    world, steps = 2, 300  # 3 ranks: the resume tests (tests/test_integration.py) train DGC on them
    dense = run_local(world, train_ddp, "dense", steps, 0.9)
    dgc = run_local(world, train_ddp, "dgc", steps, 0.0)  # DGC applies momentum 0.9 itself
    assert len({r["digest"] for r in dgc}) == 1 and len({r["digest"] for r in dense}) == 1
    initial = full_loss(mlp(0))
    assert dense[0]["loss"] < 0.1 * initial
    # Stated tolerance: after 300 steps at 99.9% sparsity (~76 of 76k coordinates a step) DGC's final loss
    # is within 0.3 of dense's. Measured here: P=2 0.33 vs 0.11, P=3 0.20 vs 0.18 — DGC trails dense on
    # short runs of small models; parity on real workloads is measured by `sparsecomm train`.
    assert dgc[0]["loss"] <= dense[0]["loss"] + 0.3, (dgc[0]["loss"], dense[0]["loss"])
    assert dgc[0]["loss"] < 0.2 * initial
    # 99.9% of the weights stay home; the 522 bias entries (under dense_below) go whole
    assert dgc[0]["stats"]["compression_ratio"] >= 50 * dense[0]["stats"]["compression_ratio"]


class EmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(500, 16, sparse=True)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


def token_batches(rank: int, steps: int):
    generator = torch.Generator().manual_seed(10 + rank)
    for _ in range(steps):
        labels = torch.randint(CLASSES, (16,), generator=generator)
        tokens = labels[:, None] * 50 + torch.randint(50, (16, 6), generator=generator)  # class-specific tokens
        yield tokens, labels


def train_embedding(rank: int, world: int, use_ddp: bool, steps: int) -> dict:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = EmbeddingModel()
    net = DDP(model) if use_ddp else model
    reducer = sc.register_ddp_hook(net, "sparcml", dense_below=1024) if use_ddp else None
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    losses = []
    for tokens, labels in token_batches(rank, steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(net(tokens), labels)
        loss.backward()
        if not use_ddp:
            assert model.embedding.weight.grad.is_sparse
            named = [(name, parameter.grad) for name, parameter in model.named_parameters()]
            reducer = sc.allreduce_gradients(named, "sparcml", reducer, dense_below=1024)
        optimizer.step()
        losses.append(float(loss.detach()))
    assert reducer is not None
    paths = {key: stats.route for key, stats in reducer.stats.tensors.items()}
    return {"first": sum(losses[:5]) / 5, "last": sum(losses[-5:]) / 5, "digest": digest(model), "paths": paths}


@pytest.mark.parametrize("use_ddp", [True, False])
def test_sparse_embedding_gradients_train_through_the_sparse_path(use_ddp):
    results = run_local(2, train_embedding, use_ddp, 80)
    assert results[0]["digest"] == results[1]["digest"]
    assert "rows" in results[0]["paths"].values()
    assert results[0]["last"] < 0.5 * results[0]["first"]


def train_manual(rank: int, world: int, spec: str, steps: int, resume_at: int | None) -> str:
    model = mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reducer = None
    saved = None
    for step, (data, labels) in enumerate(batches(rank, world, steps)):
        if resume_at is not None and step == resume_at:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "optimizer": optimizer.state_dict(), "reducer": reducer.state_dict()}
            model = mlp(99)  # a fresh process would start from scratch: load everything back
            model.load_state_dict(saved["model"])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            optimizer.load_state_dict(saved["optimizer"])
            reducer = sc.GradientReducer("dgc(ratio=0.01)+dgc_momentum+rle+fp32+allgather", seed=3, dense_below=64)
            reducer.load_state_dict(saved["reducer"])
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        reducer = sc.allreduce_gradients([(n, p.grad) for n, p in model.named_parameters()], spec, reducer,
                                         seed=3, dense_below=64)
        optimizer.step()
    return digest(model)


def test_allreduce_gradients_without_ddp_and_a_checkpoint_resumes_bit_identically():
    spec = "dgc(ratio=0.01)+dgc_momentum+rle+fp32+allgather"
    straight = run_local(2, train_manual, spec, 12, None)
    resumed = run_local(2, train_manual, spec, 12, 6)
    assert straight[0] == straight[1] == resumed[0] == resumed[1]


def accumulate_with_no_sync(rank: int, world: int) -> str:
    model = DDP(mlp(0))
    sc.register_ddp_hook(model, "topk(ratio=0.1)+residual+rice+fp32+sparse_allreduce", dense_below=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (data, labels) in enumerate(batches(rank, world, 8)):
        if step % 2 == 0:
            with model.no_sync():
                F.cross_entropy(model(data), labels).backward()
            continue
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    return digest(model)


def test_no_sync_accumulation_keeps_ranks_identical():
    results = run_local(2, accumulate_with_no_sync)
    assert results[0] == results[1]


def mismatched_registration(rank: int, world: int) -> str:
    model = DDP(mlp(0))
    try:
        sc.register_ddp_hook(model, "dgc" if rank == 0 else "sparcml")
    except sc.SparseCommError as err:
        return str(err)
    return "registered"


def test_ranks_with_different_specs_fail_at_registration():
    assert all("ranks disagree" in message for message in run_local(2, mismatched_registration, timeout=60))


def nonfinite_step(rank: int, world: int, policy: str) -> dict:
    model = mlp(0)
    reducer = sc.GradientReducer("topk(ratio=0.1)+residual+rice+fp32+allgather", nonfinite=policy, dense_below=64)
    outcome = "ok"
    for step, (data, labels) in enumerate(batches(rank, world, 3)):
        model.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        if step == 1 and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        try:
            reducer.allreduce_((n, p.grad) for n, p in model.named_parameters())
        except sc.SparseCommError as err:
            outcome = str(err)
            break
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    residual = reducer.pipeline.states["0.weight"].feedback["residual"]
    return {"outcome": outcome, "residual_finite": bool(torch.isfinite(residual).all())}


@pytest.mark.parametrize("policy", ["raise", "skip", "zero"])
def test_nonfinite_gradients_never_enter_state_and_raise_on_every_rank(policy):
    results = run_local(2, nonfinite_step, policy, timeout=60)
    assert all(r["residual_finite"] for r in results)
    if policy == "raise":
        assert all("non-finite gradient" in r["outcome"] for r in results)
    else:
        assert all(r["outcome"] == "ok" for r in results)


def stats_and_optimizer_check(rank: int, world: int) -> dict:
    import warnings

    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, "dgc", dense_below=1024)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sc.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), reducer)
        sc.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for data, labels in batches(rank, world, 5):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
    per_tensor = {key: (s.steps, s.bytes_sent, s.dense_bytes, s.route) for key, s in reducer.stats.tensors.items()}
    return {"warnings": [str(w.message) for w in caught], "summary": reducer.stats.summary(), "tensors": per_tensor}


def test_statistics_are_readable_from_the_state_and_double_momentum_is_flagged():
    result = run_local(2, stats_and_optimizer_check)[0]
    assert len(result["warnings"]) == 1 and "SGD applies its own" in result["warnings"][0]
    summary = result["summary"]
    assert summary["steps"] == 5 and summary["bytes_per_step"] == summary["bytes_sent"] / 5
    assert summary["compression_ratio"] > 50  # 99.9% sparsity on the weights; the 522 bias entries go whole
    assert summary["select_s"] > 0 and summary["transport_s"] > 0 and summary["decode_s"] > 0
    (steps, sent, dense, path), = result["tensors"].values()
    assert steps == 5 and path == "compressed" and dense == 5 * 4 * sum(p.numel() for p in mlp(0).parameters())


def dgc_on_uncompressed_tensors(rank: int, world: int) -> list[torch.Tensor]:
    steps = []
    reducer = None
    for step in range(3):
        small = torch.full((10,), float(rank + step))  # below dense_below: sent by a plain all_reduce
        rows = torch.tensor([[rank, 2 + step]])  # embedding-style sparse rows, sent exactly by top-k's rule
        sparse = torch.sparse_coo_tensor(rows, torch.ones(2, 3) * (rank + 1), (5, 3), check_invariants=True)
        reducer = sc.allreduce_gradients([("small", small), ("embedding", sparse)],
                                         "topk(ratio=0.001)+dgc_momentum(momentum=0.9)+rle+fp32+allgather", reducer)
        steps.append((small.clone(), sparse.to_dense()))
    return steps


def test_dgc_gives_tensors_it_sends_uncompressed_the_momentum_the_optimizer_leaves_out():
    m, world = 0.9, 2
    results = run_local(world, dgc_on_uncompressed_tensors)
    small_buffer, embedding_buffer = torch.zeros(10), torch.zeros(5, 3)
    for step in range(3):
        small_average = torch.full((10,), sum(rank + step for rank in range(world)) / world)
        embedding_average = torch.zeros(5, 3)
        for rank in range(world):
            embedding_average[[rank, 2 + step]] += (rank + 1) / world
        small_buffer = m * small_buffer + small_average  # what SGD(momentum=0.9) would step with
        embedding_buffer = m * embedding_buffer + embedding_average
        for rank in range(world):
            small, embedding = results[rank][step]
            torch.testing.assert_close(small, small_buffer)
            torch.testing.assert_close(embedding, embedding_buffer)


DGC_ON_ROWS = "dgc(ratio=0.01)+residual+raw+fp32+allgather"


def dgc_on_rows(rank: int, world: int) -> dict:
    fed, delivered, reducer = torch.zeros(400, 32, dtype=torch.float64), torch.zeros(400, 32, dtype=torch.float64), None
    sent = []  # nonzero entries of each step's average
    for step in range(4):
        sparse = embedding_rows(rank + 2 * step)
        fed += sparse.to_dense()
        reducer = sc.allreduce_gradients([("embedding", sparse)], DGC_ON_ROWS, reducer)
        assert sparse.is_sparse
        delivered += sparse.to_dense()
        sent.append(int((sparse.to_dense() != 0).sum()))
    assert reducer is not None
    held = reducer.pipeline.states["embedding"].feedback["residual"].reshape(400, 32).double()
    reducer.close()
    dist.all_reduce(fed)
    dist.all_reduce(held)
    return {"fed": fed, "delivered_and_held": delivered * world + held, "entries": sent}


def test_dgc_selects_from_an_embeddings_rows_as_from_the_matrix_they_stand_for():
    """DGC's code sparsifies an embedding's gradient as any matrix: 1% of its 12,800 entries a step
    (about 128 per rank), not all 1,920 of a rank's rows; the rest waits in the feedback, so over
    steps nothing is lost, and the average still comes back as sparse rows."""
    for result in run_local(2, dgc_on_rows):
        assert all(0 < entries <= 2 * 1.3 * 128 for entries in result["entries"])  # of up to 2 × 1,920
        torch.testing.assert_close(result["delivered_and_held"], result["fed"], rtol=0, atol=1e-5)


def embedding_rows(rank: int) -> torch.Tensor:
    """A rank's embedding-style sparse gradient: rows of magnitudes from 1e-6 to 1 side by side, as
    rare and frequent words' rows are (a blockwise quantizer rounds the small ones to nothing)."""
    generator = torch.Generator().manual_seed(rank)
    rows = torch.randperm(400, generator=generator)[:60].sort().values
    scales = 10.0 ** -torch.randint(0, 7, (60, 1), generator=generator).float()
    values = torch.randn(60, 32, generator=generator) * scales
    return torch.sparse_coo_tensor(rows[None], values, (400, 32), check_invariants=True)


def reduce_embedding_rows(rank: int, world: int, spec: str) -> tuple[list[torch.Tensor], dict[str, int]]:
    averages, reducer = [], None
    for _ in range(3):  # adaptive's first step is dense (sparse rows by a sparse all_reduce): then sparse
        sparse, weight = embedding_rows(rank), torch.randn(8192, generator=torch.Generator().manual_seed(rank))
        reducer = sc.allreduce_gradients([("embedding", sparse), ("weight", weight)], spec, reducer)
        averages.append(sparse.to_dense())
    assert reducer is not None
    modes = dict(reducer.adaptive.planner.mode_steps) if reducer.adaptive is not None else {"sparse": 3}
    reducer.close()
    return averages, modes


@pytest.mark.parametrize("spec", [
    "deepreduce", "deepreduce-qsgd",  # Bloom-filter indices; curve-fitted or quantized values
    "skcompress",  # quantile buckets coding indices and values together
    "s2",  # a count sketch
    "topk(ratio=0.01)+residual+raw+fp32+sparse_allreduce(algorithm=dsar_sa,qsgd_bits=4)",  # a 4-bit dense phase
])
def test_sparse_rows_are_averaged_exactly_whatever_the_pipelines_codecs_and_transport(spec):
    results = run_local(2, reduce_embedding_rows, spec)
    exact = (embedding_rows(0).to_dense() + embedding_rows(1).to_dense()) / 2
    for averages, modes in results:
        assert modes.get("sparse", 0) >= 2
        for averaged in averages:
            assert torch.equal(averaged, exact)


def reduce_rows_in_8_bits(rank: int, world: int) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, int]]:
    averages, reducer = [], None
    for step in range(4):  # other rows each step: an entry's error waits for its row to come back
        sparse, weight = embedding_rows(rank + 2 * step), torch.randn(8192)
        reducer = sc.allreduce_gradients([("embedding", sparse), ("weight", weight)],
                                         "adaptive(budget=2000)+residual+rice+int8+allgather", reducer)
        averages.append(sparse.to_dense())
    assert reducer is not None and reducer.adaptive is not None
    held = reducer.state_dict()["row_errors"]["embedding"].view(400, 32)
    modes = dict(reducer.adaptive.planner.mode_steps)
    with sc.GradientReducer("adaptive(budget=2000)+residual+rice+int8+allgather") as resumed:
        resumed.load_state_dict(reducer.state_dict())  # the held errors are state: a resume keeps them
        assert torch.equal(resumed.state_dict()["row_errors"]["embedding"].view(400, 32), held)
    reducer.close()
    return averages, held, modes


def test_sparse_rows_in_a_lossy_rounding_keep_its_error_until_their_row_is_sent_again():
    results = run_local(2, reduce_rows_in_8_bits)
    exact = [sum(embedding_rows(rank + 2 * step).to_dense() for rank in range(2)) / 2 for step in range(4)]
    for averages, _, modes in results:
        assert modes.get("sparse", 0) >= 3
        assert not torch.equal(averages[-1], exact[-1])  # sent in 8 bits
        assert torch.equal(averages[-1], results[0][0][-1])  # the same sum on every rank
    # what was sent, plus what every rank still holds, is exactly what there was to send
    held = sum(result[1] for result in results) / 2
    torch.testing.assert_close(sum(results[0][0]) + held, sum(exact), rtol=1e-6, atol=1e-7)


def rows_skipped_on_one_rank(rank: int, world: int) -> torch.Tensor:
    rows = embedding_rows(rank).coalesce()
    values = rows.values().clone()
    if rank == 1:
        values[0, 0] = float("nan")
    rows = torch.sparse_coo_tensor(rows.indices(), values, rows.shape, check_invariants=True)
    with sc.GradientReducer("topk(ratio=0.1)+residual+rice+int8+allgather", nonfinite="skip") as reducer:
        reducer.allreduce_([("embedding", rows)])
    return rows.to_dense()


def test_a_rank_skipping_its_non_finite_rows_leaves_the_others_rounded_rows_to_average():
    """The rank that skips sends nothing, in the same value format as the others' rounded rows."""
    results = run_local(2, rows_skipped_on_one_rank)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], embedding_rows(0).to_dense() / 2, rtol=0, atol=1e-2)
    assert not torch.equal(results[0], embedding_rows(0).to_dense() / 2)  # 8-bit values


@pytest.mark.parametrize("shape, sparse_dim", [((7, 3), 1), ((4, 5, 2), 2), ((6,), 1), ((5, 3), 2)])
def test_reduced_sparse_gradients_are_the_nonzero_rows_torch_would_give(shape, sparse_dim):
    from sparsecomm.sparse_gradient import nonzero_rows

    dense = torch.zeros(shape)
    dense.view(-1)[torch.tensor([0, 2, dense.numel() - 1])] = torch.tensor([1.0, -2.0, 4.0])
    odd = torch.zeros(shape)  # rows of -0.0 alone count as zero; NaN, Inf and the least subnormal do not
    odd.view(-1)[torch.tensor([0, 1, 2, odd.numel() // 2, odd.numel() - 1])] = torch.tensor(
        [-0.0, float("nan"), -float("inf"), -0.0, torch.finfo(torch.float32).smallest_normal / 2**23])
    for tensor in (dense, torch.zeros(shape), odd):
        ours, torchs = nonzero_rows(tensor, sparse_dim), tensor.to_sparse(sparse_dim=sparse_dim).coalesce()
        assert ours.is_coalesced() and ours.sparse_dim() == sparse_dim
        assert torch.equal(ours.indices(), torchs.indices())
        torch.testing.assert_close(ours.values(), torchs.values(), rtol=0, atol=0, equal_nan=True)


def test_nonzero_rows_of_rows_without_columns_are_none():
    from sparsecomm.sparse_gradient import nonzero_rows

    empty = nonzero_rows(torch.zeros(4, 0), 1)
    assert empty.shape == (4, 0) and empty.indices().shape == (1, 0)
