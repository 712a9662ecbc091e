"""CUDA gradients and NCCL, wherever a GPU is present (skipped elsewhere): every collective on its
backend's device — NCCL refuses CPU tensors, so one misplaced buffer fails these — results on the
gradient's device, and the same values as the CPU run of the same inputs and seeds."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sparsecomm as sc
from helpers import contribution
from sparsecomm.adaptive.config import Mode
from sparsecomm.adaptive.gradient_energy import energy_share
from sparsecomm.launch import run_local
from sparsecomm.transport.request import Request
from sparsecomm.transport.session import TransportSession
from test_adaptive_reducer import on_a_slow_link
from test_device_mode import moving
from test_grad_scaler import scaled_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")

EXACT = ["allgather", "dense", "auto", "sparse_allreduce(algorithm=ssar_rd)", "sparse_allreduce(algorithm=ssar_sa)",
         "sparse_allreduce(algorithm=dsar_sa)"]
LOSSY = ["sparse_allreduce(algorithm=dsar_sa,qsgd_bits=4)", "sketch_allreduce(ratio=2.0,block=16)",
         "dense(dtype=fp16)"]
OVERLAPS = ["random", "full", "all_empty", "dense_result"]
DEVICE_ROUTE = "dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+raw+fp32+allgather"
"""a pipeline on the device route (`sparsecomm.device`)"""
DEVICE_ROUTE_PACKED = "dgc(ratio=0.01)+residual+packed+int8+allgather"
"""the device route with packed indices and 8-bit values"""
ADAPTIVE_DEVICE_ROUTE = "adaptive(budget=20000)+residual+packed+int8+allgather"
"""``adaptive``'s sparse steps on the device route, its density shared out over each bucket"""


def every_transport(rank: int, world: int, cpu_group_backend: str) -> dict:
    """Each transport on this rank's CUDA contribution over the default group, and on the same
    contribution on the CPU over a gloo group of the same ranks: (device, max |CUDA − CPU|, max |CUDA − exact|)."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    cpu_group = dist.new_group(backend=cpu_group_backend)
    out = {}
    with TransportSession() as session, TransportSession() as cpu_session:
        for overlap in OVERLAPS:
            grad = contribution(rank, world, overlap)
            exact = grad.clone()
            dist.all_reduce(exact, group=cpu_group)
            for text in EXACT + LOSSY:
                transport = sc.parse_spec(text).transport
                request = Request(key=f"{overlap} {text}", seed=1, index_codec=sc.INDEX_CODECS.create("rice"))
                on_gpu = transport.reduce_async(sc.SparseGradient.from_dense(grad.cuda()), request=request,
                                                session=session).wait().total
                on_cpu = transport.allreduce(sc.SparseGradient.from_dense(grad), cpu_group, request,
                                             session=cpu_session)
                out[(overlap, text)] = (on_gpu.device.type, float((on_gpu.cpu() - on_cpu).abs().max()),
                                        float((on_gpu.cpu() - exact).abs().max()))
    return out


def check_transports(results: list[dict]) -> None:
    for per_rank in results:
        for (overlap, text), (device, versus_cpu, versus_exact) in per_rank.items():
            assert device == "cuda", (overlap, text)
            if text in EXACT:
                assert versus_cpu == 0.0, f"{text} ({overlap}) differs from its CPU run by {versus_cpu}"
                assert versus_exact <= 1e-5, (overlap, text, versus_exact)
            else:
                assert versus_cpu <= 1e-4, f"{text} ({overlap}) differs from its CPU run by {versus_cpu}"


def test_every_transport_runs_on_nccl_with_its_buffers_on_the_gpu():
    check_transports(run_local(1, every_transport, "gloo", backend="nccl", timeout=240))


def test_gloo_carries_cuda_gradients_and_returns_them_to_the_gpu():
    check_transports(run_local(2, every_transport, "gloo", backend="gloo", timeout=240))


def ddp_steps(rank: int, world: int, preset: str, device: str, steps: int) -> dict:
    """A few DDP steps of a small MLP with ``preset`` as the hook, on ``device``."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    reducer = sc.GradientReducer(preset, model=ddp, seed=3, dense_below=64)
    ddp.register_comm_hook(reducer, sc.ddp_comm_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        inputs = torch.randn(32, 64, generator=generator).to(device)
        targets = torch.randint(0, 10, (32,), generator=generator).to(device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    reducer.close()
    return {"losses": losses, "devices": {p.grad.device.type for p in model.parameters()},
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "routes": {stats.route for stats in reducer.stats.tensors.values()}}


def rank_disagreements(rank: int, world: int, preset: str, steps: int) -> int:
    """Steps on which this rank's averaged gradients differ from rank 0's: a 16.8M-parameter MLP on
    the GPU, gloo carrying its CUDA buckets, large enough that work left on a side stream shows."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048)).cuda()
    ddp = nn.parallel.DistributedDataParallel(model)
    reducer = sc.GradientReducer(preset, model=ddp, seed=3)
    ddp.register_comm_hook(reducer, sc.ddp_comm_hook)
    generator = torch.Generator(device="cuda").manual_seed(rank)
    disagreements = 0
    for _ in range(steps):
        ddp.zero_grad()
        ddp(torch.randn(16, 2048, generator=generator, device="cuda")).square().mean().backward()
        mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        first = mine.clone()
        dist.broadcast(first, 0)
        disagreements += not torch.equal(mine, first)
    reducer.close()
    return disagreements


@pytest.mark.parametrize("preset", ["adaptive", "dense", "dgc", DEVICE_ROUTE, DEVICE_ROUTE_PACKED,
                                    ADAPTIVE_DEVICE_ROUTE])
def test_every_rank_applies_the_same_sum_on_every_step_when_gloo_carries_cuda_gradients(preset):
    assert run_local(2, rank_disagreements, preset, 30, timeout=240) == [0, 0]


@pytest.mark.parametrize("preset", [*sc.available_presets(), DEVICE_ROUTE, DEVICE_ROUTE_PACKED, ADAPTIVE_DEVICE_ROUTE])
def test_the_ddp_hook_runs_every_preset_on_nccl(preset):
    (gpu,) = run_local(1, ddp_steps, preset, "cuda", 4, backend="nccl", timeout=240)
    (cpu,) = run_local(1, ddp_steps, preset, "cpu", 4, backend="gloo", timeout=240)
    assert gpu["devices"] == {"cuda"} and gpu["finite"]
    # the same first step (same weights and data; a GPU's matmuls round differently, so close, not equal)
    torch.testing.assert_close(gpu["losses"][0], cpu["losses"][0], rtol=1e-4, atol=1e-5)
    assert gpu["losses"][-1] < gpu["losses"][0] + 0.5
    if preset == "dgc":  # its codecs' host work left to CPUs: on a GPU its device form
        assert "device" in gpu["routes"] and "device" not in cpu["routes"], (gpu["routes"], cpu["routes"])


def test_a_sparse_selection_reaches_the_host_in_one_copy():
    selection = sc.SparseGradient(torch.tensor([3, 9, 40], device="cuda"),
                                  torch.tensor([1.5, -2.0, 0.25], device="cuda"), torch.Size([64]))
    host = selection.to_host()
    assert host.indices.device.type == "cpu" and host.values.device.type == "cpu"
    assert host.indices.tolist() == [3, 9, 40] and host.values.tolist() == [1.5, -2.0, 0.25]
    assert host.values.untyped_storage().data_ptr() == host.indices.untyped_storage().data_ptr()  # one buffer
    assert host.indices.is_pinned()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_one_pass_gpu_selection_keeps_exactly_what_nonzero_keeps(dtype):
    from sparsecomm.sparsify.cuda_select import indices_at_or_above  # the kernel itself, at every size

    generator = torch.Generator(device="cuda").manual_seed(4)
    for numel in (1, 4095, 4097, 1_000_003):
        flat = torch.randn(numel, generator=generator, device="cuda").to(dtype)
        flat[:: max(1, numel // 7)] = float("nan")
        flat[1 :: max(1, numel // 5)] = float("-inf")
        for threshold in (0.0, 1e-3, 1.0, torch.tensor(2.5, device="cuda"), 1e9):
            got = indices_at_or_above(flat, threshold)
            want = torch.nonzero(flat.abs() >= threshold).squeeze(1)
            assert torch.equal(got, want), (numel, threshold)


def test_the_triton_kernels_serve_only_tensors_large_enough_to_repay_their_start():
    from sparsecomm.sparsify.base import TRITON_MIN_NUMEL, gpu_kernels

    assert gpu_kernels(torch.empty(TRITON_MIN_NUMEL - 1, device="cuda"), "cuda_select") is None
    assert gpu_kernels(torch.empty(TRITON_MIN_NUMEL, device="cuda"), "cuda_select") is not None
    assert gpu_kernels(torch.empty(TRITON_MIN_NUMEL, device="cuda", dtype=torch.float64), "cuda_select") is None


def test_dgc_on_the_gpu_selects_about_k_without_a_host_round_trip_for_the_threshold():
    flat = torch.randn(2_000_000, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
    dgc = sc.SPARSIFIERS.parse("dgc(ratio=0.001)")
    threshold = dgc.sampled_threshold(flat, 2000, torch.Generator(device="cuda").manual_seed(2))
    assert isinstance(threshold, torch.Tensor) and threshold.device.type == "cuda"
    selection = dgc.sparsify(flat, torch.Generator(device="cuda").manual_seed(2))
    assert selection.indices.device.type == "cuda" and 0.8 * 2000 <= selection.nnz <= 1.3 * 2000
    assert torch.equal(selection.indices, selection.indices.sort().values)
    assert torch.equal(selection.values, flat[selection.indices])
    assert float(selection.values.abs().min()) >= float(flat.abs().kthvalue(flat.numel() - 2 * 2000).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_gpu_sampled_threshold_is_the_sample_top_rounded_down_to_8_significant_bits(dtype):
    from sparsecomm.sparsify.dgc_threshold import device_sampled_threshold

    flat = torch.randn(4_500_001, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda").to(dtype)
    for k, stride in ((3000, 100), (30, 1000), (300_000, 7), (1, 1)):
        threshold = device_sampled_threshold(flat, k, stride, torch.Generator(device="cuda").manual_seed(6))
        start = int(torch.randint(stride, (1,), generator=torch.Generator(device="cuda").manual_seed(6), device="cuda"))
        count = flat.numel() // stride
        samples = flat[start + torch.arange(count, device="cuda") * stride].abs().float()
        exact = torch.topk(samples, -(-count * k // flat.numel())).values.min()
        rounded = torch.tensor(int(exact.view(torch.int32)) >> 15 << 15, dtype=torch.int32).view(torch.float32)
        assert threshold.device.type == "cuda" and float(threshold) == float(rounded), (k, stride)


def test_the_training_job_runs_every_kind_of_row_on_gpus_with_ranks_in_step():
    """`sparsecomm train --device cuda`: two ranks on the GPU(s), gloo carrying CUDA gradients, for
    PyTorch's own rows and sparsecomm's hooks alike; every rank ends with the same weights."""
    from sparsecomm.train.runner import run

    rows = ["torch-allreduce", "torch-fp16", "torch-powersgd-r1", "adaptive", "dgc"]
    result = run("digits", rows, workers=2, steps=60, device="cuda")
    assert result["device"] == "cuda" and [row["preset"] for row in result["rows"]] == rows
    for row in result["rows"]:
        assert row["ranks_identical"], row["preset"]
        assert row["final_metric"] > 50, row  # 60 steps learn digits well past chance
    assert all(len(curve["losses"]) == 60 for curve in result["curves"].values())


def test_the_energy_curve_of_a_cuda_sample_is_the_cpu_curve():
    """`adaptive` reads its density from a sample of the gradient where the gradient is."""
    squares = torch.randn(16_384, generator=torch.Generator().manual_seed(5)).pow(6)  # heavy-tailed
    fractions = torch.logspace(-3, 0, 64, dtype=torch.float64)
    on_gpu = energy_share(squares.cuda(), fractions)
    assert on_gpu.device.type == "cuda"  # where the squares are: no host read
    torch.testing.assert_close(on_gpu.cpu(), energy_share(squares, fractions), rtol=1e-9, atol=1e-12)


def test_cuda_gradients_on_a_held_link_leave_every_rank_with_the_same_plans_densities_and_weights():
    """The sampled energy, the preference in the side report and the plans, with gloo carrying the
    CUDA buckets: every rank the same plans, preferences and weights, sparse steps on both routes
    at a density the gradients preferred. The link is held at 1 MB/s for the predictions only: the
    trials time whole steps, and on a GPU the loopback under the test carries an fp16 step faster
    than a sparse step runs, so later steps may rightly go dense (on a processor they stay sparse)."""
    first, second = run_local(2, on_a_slow_link, 40, "cuda", timeout=240)
    assert first["plans"] == second["plans"] and first["digest"] == second["digest"]
    preferred = first["preferred"]
    assert preferred == second["preferred"] and len(preferred) >= 3
    assert all(0.001 <= density <= 0.25 for density in preferred)
    assert {Mode.SPARSE, Mode.DEVICE} <= {plan.mode for plan in first["plans"]}  # both routes weighed
    assert all(plan.density <= max(preferred) for plan in first["plans"] if plan.mode.selects)


def test_sparse_embedding_updates_leave_every_rank_with_the_same_weights_on_the_gpu():
    """SGD with momentum adds a sparse gradient's uncoalesced momentum with atomic additions on a GPU;
    the job runs the optimizer's step deterministically, or the ranks' embeddings drift apart."""
    from sparsecomm.train.runner import run

    result = run("lm", ["torch-allreduce", "dense"], workers=2, steps=8, device="cuda")
    assert [row["ranks_identical"] for row in result["rows"]] == [True, True]


LIGHTNING_ON_A_GPU = """
import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import sparsecomm as sc


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def training_step(self, batch, batch_index):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


model = Classifier()
reducer = sc.GradientReducer("dgc", model=model)  # before Lightning initialises torch.distributed
trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=12, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    strategy=DDPStrategy(ddp_comm_state=reducer, ddp_comm_hook=sc.ddp_comm_hook))
trainer.fit(model, DataLoader(TensorDataset(torch.randn(512, 64), torch.randint(10, (512,))), batch_size=32))
assert reducer.started and reducer.stats.steps == 12, reducer.stats.steps
print("steps", reducer.stats.steps)
"""


def test_lightnings_ddp_strategy_registers_a_reducer_built_before_torch_distributed_on_a_gpu(tmp_path):
    """Lightning registers a strategy's hook only on CUDA: the reducer it is given starts at its first
    bucket and reduces every step."""
    import subprocess
    import sys

    pytest.importorskip("lightning")  # the GPU machine's image may lack it: carry its wheels (scripts/gpu-wheels)
    script = tmp_path / "lightning_gpu.py"
    script.write_text(LIGHTNING_ON_A_GPU)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(script)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "steps 12" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.parametrize("density", [0.001, 0.05, 0.5])
def test_the_device_routes_wire_is_the_same_bits_on_a_gpu(density):
    from sparsecomm.device.wire import WireFormat

    numel = 100_003
    generator = torch.Generator().manual_seed(5)
    indices = torch.randperm(numel, generator=generator)[:int(numel * density)].sort().values
    values, whole = torch.randn(indices.numel(), generator=generator), torch.randn(7, generator=generator)
    form = WireFormat(numel, indices.numel(), 7, sc.VALUE_CODECS.parse("int8"), packed=True)
    words = {}
    for device in ("cpu", "cuda"):
        out = torch.empty(form.words, dtype=torch.int32, device=device)
        delivered = form.pack(out, 7, indices.to(device), torch.cat([values, whole]).to(device))
        whole_indices = torch.arange(numel - 7, numel, device=device)
        total, agreed, _, _ = form.unpack_sum(out, 1, 7, whole_indices, torch.device(device))
        assert bool(agreed) and total.device.type == device
        words[device] = (out.cpu(), delivered.cpu(), total.cpu())
    for part, on_cpu, on_gpu in zip(("words", "delivered", "sum"), words["cpu"], words["cuda"], strict=True):
        assert torch.equal(on_cpu, on_gpu), (part, int((on_cpu != on_gpu).sum()))


def test_one_threshold_over_the_bucket_is_the_same_on_a_gpu_as_in_host_memory_without_a_host_read():
    """`adaptive`'s shared threshold on the device route: the tensor form on CUDA gives the
    thresholds and share the processor's numpy form gives for the same samples, and reads nothing."""
    from sparsecomm.bench.op_counts import count_ops
    from sparsecomm.device import selection, shares
    from sparsecomm.device.layout import BucketLayout
    from sparsecomm.pipeline import Segment

    sizes = [2560, 131_072, 300, 40_000]
    segments, start = [], 0
    for i, numel in enumerate(sizes):
        segments.append(Segment(f"p{i}", start, numel))
        start += numel
    values = torch.randn(start + 1, generator=torch.Generator().manual_seed(6))
    values[:2560] *= 30
    values[-1] = 0.0

    def sampled(device: str) -> tuple:
        layout = BucketLayout.of(segments, start, torch.device(device))
        grid = layout.at_ratio(0.01 / 1.5).grid  # the same offsets: a processor's generator either way
        samples = selection._sampled(values.to(device), grid, torch.Generator().manual_seed(3))
        return samples, grid, *selection._at_ranks(samples, grid, grid.both_ranks).unbind(1)

    samples, grid, own, floor = sampled("cpu")
    on_host = shares.lowered_in_host_memory(samples.numpy(), grid, own.numpy(), floor.numpy())
    on_gpu = sampled("cuda")
    assert count_ops(lambda: shares.lowered(*on_gpu), 1).syncs == 0
    candidates, members, share = shares.lowered(*on_gpu)
    torch.testing.assert_close(candidates.cpu(), torch.from_numpy(on_host[0]))
    torch.testing.assert_close(members.cpu(), torch.from_numpy(on_host[1]))
    assert float(share) == pytest.approx(on_host[2], rel=1e-4)


def test_adaptive_weighs_cuda_gradients_under_deterministic_algorithms_as_without():
    """torch's documentation lists a floating-point cumsum on CUDA among what deterministic
    algorithms refuse: the energy curve, the bucket's shared threshold and the host path's shares
    give the same numbers with them on."""
    from sparsecomm.device import selection, shares
    from sparsecomm.device.cumulative import cumulative
    from sparsecomm.device.layout import BucketLayout
    from sparsecomm.pipeline import Segment
    from sparsecomm.sparsify.shared_threshold import density_shares

    squares = torch.randn(16_384, generator=torch.Generator().manual_seed(5)).pow(6).cuda()
    fractions = torch.logspace(-3, 0, 64, dtype=torch.float64)
    layout = BucketLayout.of([Segment("a", 0, 50_000), Segment("b", 50_000, 9_000)], 59_000, torch.device("cuda"))
    grid = layout.at_ratio(0.01).grid
    values = torch.randn(59_001, generator=torch.Generator().manual_seed(6)).cuda()
    samples = selection._sampled(values, grid, torch.Generator().manual_seed(3))
    both = selection._at_ranks(samples, grid, grid.both_ranks).unbind(1)
    sampled = {"a": (50_000, values[:4096].abs()), "b": (9_000, values[-4096:].abs() * 3)}
    free = energy_share(squares, fractions), shares.lowered(samples, grid, *both), density_shares(sampled, 0.01)
    torch.use_deterministic_algorithms(True)
    try:
        held = energy_share(squares, fractions), shares.lowered(samples, grid, *both), density_shares(sampled, 0.01)
        assert cumulative(squares).device.type == "cuda"
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(held[0], free[0], rtol=1e-9, atol=1e-12)
    for got, expected in zip(held[1], free[1], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert held[2] == pytest.approx(free[2], rel=1e-9)


def test_a_sketch_on_the_gpu_peels_to_the_bits_the_host_peels_it_to():
    """Every rank peels the same summed sketch on its own: a GPU's atomic additions would take a
    cell's repeated entries in no fixed order, so the ranks could reach different bits."""
    from sparsecomm.transport.sketch_allreduce import peel

    generator = torch.Generator().manual_seed(7)
    rows, columns, count = 3, 26_000, 20_000
    buckets = torch.randint(columns, (rows, count), generator=generator)
    signs = torch.randint(2, (rows, count), generator=generator).float().mul_(2).sub_(1)
    values = torch.randn(count, generator=generator)
    sketch = torch.zeros(rows, columns)
    for row in range(rows):
        sketch[row].index_add_(0, buckets[row], signs[row] * values)
    on_host = peel(sketch, buckets, signs)
    on_gpu = peel(sketch.cuda(), buckets.cuda(), signs.cuda())
    assert on_gpu[0].device.type == "cuda"
    assert torch.equal(on_gpu[0].cpu(), on_host[0]) and torch.equal(on_gpu[1].cpu(), on_host[1])


def test_the_counters_read_the_bytes_copied_between_host_and_device():
    from sparsecomm.bench.op_counts import count_ops

    on_gpu = torch.ones(1 << 18, device="cuda")  # 1 MiB
    pinned = torch.empty(1 << 18, pin_memory=True)

    def step() -> None:
        pinned.copy_(on_gpu, non_blocking=True)  # down, then up again; a copy within the device is not counted
        on_gpu.copy_(pinned, non_blocking=True)
        on_gpu.clone()

    assert count_ops(step, 3, "cuda").host_device_bytes == 2 * on_gpu.nbytes


def test_steps_that_move_between_the_codecs_and_the_device_route_lose_nothing_on_a_gpu():
    """`adaptive`'s sparse steps on the host codecs and on the device route by turns, gloo carrying
    CUDA gradients: ranks alike, nothing lost, each step on the route its plan named."""
    (model, missing, routes), (other, _, _) = run_local(2, moving, None, "cuda", timeout=240)
    assert model == other and missing < 1e-5, missing
    assert routes.count("device") == 4 and routes.count("compressed") == 3


@pytest.mark.parametrize("preset", ["adaptive", "dgc", DEVICE_ROUTE])
def test_fp16_autocast_and_a_grad_scaler_skip_one_ranks_overflow_on_every_rank_on_gpus(preset):
    """`nonfinite="propagate"` with CUDA gradients under fp16 autocast (two ranks, gloo carrying
    them): rank 1's overflow at the third step halves every rank's scale and the ranks stay alike."""
    (scales, overflowed, first, _), (other_scales, other_overflowed, second, _) = run_local(
        2, scaled_steps, preset, "mlp", float("inf"), "cuda", timeout=300)
    assert overflowed == other_overflowed == [False, False, True, False, False]
    assert scales == other_scales == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert first == second
