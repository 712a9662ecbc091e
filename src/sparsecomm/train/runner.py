"""Runs one workload with each preset on P local gloo workers (DDP + the sparsecomm hook) — or, when
started by torchrun, on the job's own ranks — and collects what the table, the JSON and the plot show."""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sparsecomm.adaptive.config import Mode
from sparsecomm.errors import SparseCommError
from sparsecomm.launch import run_local
from sparsecomm.netns import bits_per_second, bytes_sent_here
from sparsecomm.presets import resolve
from sparsecomm.reducer.ddp_hook import register_ddp_hook
from sparsecomm.reducer.fsdp_hook import FSDPCompression
from sparsecomm.reducer.hierarchical import HierarchicalReducer
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.reducer.sparse_reduce_scatter import FlatFSDPCompression
from sparsecomm.reducer.topology import Topology
from sparsecomm.spec import format_spec
from sparsecomm.train import sharded, sparse_rows
from sparsecomm.train.baselines import BASELINES, BytesMeter, has_sparse_gradients
from sparsecomm.train.regime import matching_rate
from sparsecomm.train.row_names import HIERARCHICAL, SHARDED_BASELINES, is_sharded, preset_of
from sparsecomm.train.update_rule import UpdateRule
from sparsecomm.train.workloads import Workload
from sparsecomm.train.workloads import workload as load_workload


def format_rate(bits_per_s: float) -> str:
    """1.5e8 → '150mbit' (the form ``tc`` and ``bits_per_second`` read)."""
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= factor:
            return f"{bits_per_s / factor:g}{suffix}"
    return f"{bits_per_s:g}"


def default_link(task: Workload, workers: int, batch: int, seed: int, device: str = "cpu") -> tuple[str, str]:
    """(rate, why) of the link the main job trains on when not told: the workload's dense bytes and
    its compute per step, measured on ``workers`` local workers at once, as training runs them."""
    compute_s = max(run_local(workers, _compute_probe, task, batch, seed, device))
    dense_bytes = 4 * sum(p.numel() for p in task.model(seed).parameters())
    regime = task.regime
    rate = format_rate(matching_rate(dense_bytes, compute_s, regime))
    why = (f"{rate}: a dense all_reduce of {task.name}'s {dense_bytes / 1e3:,.0f} kB then takes {regime.ratio:.0f}x "
           f"its {compute_s * 1e3:.1f} ms of compute per step here, as for {regime.described}")
    return rate, why


def _compute_probe(rank: int, world: int, task: Workload, batch: int, seed: int, device: str) -> float:
    return compute_seconds_per_step(task, batch, seed, trials=30, device=worker_device(device, rank))


def worker_device(device: str, rank: int) -> torch.device:
    """Where rank ``rank`` trains: the CPU, or with ``device='cuda'`` the GPU of its local rank
    (torchrun's ``LOCAL_RANK``, else ``rank``) modulo the GPUs present. Several ranks may share one
    GPU: their collectives run on gloo, which carries CUDA tensors through the host, as between
    machines on an Ethernet network."""
    check_device(device)
    if device == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def check_device(device: str) -> None:
    """Raise `SparseCommError` unless ``device`` is 'cpu', or 'cuda' with a GPU present."""
    if device not in ("cpu", "cuda"):
        raise SparseCommError(f"unknown device {device!r}; use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise SparseCommError("--device cuda: no CUDA device is available here")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.to(device, non_blocking=True) for tensor in batch)


@contextmanager
def identical_update() -> Iterator[None]:
    """Run the optimizer's step with PyTorch's deterministic algorithms, so every rank turns the same
    averaged gradient into the same weights. On a GPU, SGD with momentum keeps a sparse gradient's
    momentum uncoalesced and adds it to the weights with atomic additions, which sum a row's
    duplicates in any order: on the H100 the lm model's embedding weights differed between the two
    ranks after the first step, from identical gradients (deterministic: never, in 25 steps)."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def compute_seconds_per_step(task: Workload, batch: int, seed: int, trials: int = 5,
                             device: torch.device | None = None, rule: UpdateRule | None = None) -> float:
    """Forward + backward + optimizer step (``rule``'s, else the workload's) of the workload's model
    alone (no communication), median."""
    device = device or torch.device("cpu")
    model = task.model(seed).to(device)
    optimizer, _ = (rule or UpdateRule.of(task)).build(model, None)
    times = []
    for batch_data in task.batches(0, 1, trials + 1, batch, seed + 1):
        tick = time.perf_counter()
        optimizer.zero_grad()
        task.loss(model, on_device(batch_data, device)).backward()
        optimizer.step()
        synchronize(device)
        times.append(time.perf_counter() - tick)
    return sorted(times[1:])[len(times[1:]) // 2]


Reducer = GradientReducer | HierarchicalReducer | FSDPCompression | FlatFSDPCompression
"""what a sparsecomm row reduces its gradients with"""


def ddp_options(task: Workload) -> dict[str, Any]:
    """What every DDP row of ``task`` is built with: its bucket size and whether DDP broadcasts
    rank 0's buffers each forward, where the workload departs from PyTorch's defaults."""
    options: dict[str, Any] = {}
    if task.ddp_bucket_mb is not None:
        options["bucket_cap_mb"] = task.ddp_bucket_mb
    if not task.ddp_broadcast_buffers:  # PyTorch ≥ 2.13 names it forward_sync_buffers
        accepted = inspect.signature(DistributedDataParallel.__init__).parameters
        options["forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"] = False
    return options


def average_buffers(module: nn.Module) -> None:
    """Each floating-point buffer (batch normalisation's running statistics) replaced by its mean
    over the ranks, in one all_reduce: what a row evaluates where the ranks kept their own."""
    buffers = [buffer for buffer in module.buffers() if buffer.is_floating_point()]
    if not buffers or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flat = torch.cat([buffer.detach().reshape(-1).double() for buffer in buffers])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for buffer, mean in zip(buffers, flat.split([buffer.numel() for buffer in buffers]), strict=True):
        buffer.copy_(mean.view_as(buffer))


def _wrapped(row: str, module: nn.Module, world: int, nodes: int, seed: int, ddp: Mapping[str, Any] | None = None
             ) -> tuple[nn.Module, Reducer | None, BytesMeter | None]:
    """The row's model, and what counts its bytes: its reducer, or a meter for PyTorch's rows.
    ``ddp``: what DDP is built with (`ddp_options`)."""
    baseline = BASELINES.get(row)
    if baseline is not None:
        model, meter = baseline.wrap(module, ddp)
        return model, None, meter
    if is_sharded(row):
        return sharded.build(row, module, nodes, seed)
    model = DistributedDataParallel(module, **(ddp or {}))
    topology = Topology(world // nodes) if row.startswith(HIERARCHICAL) else None
    return model, register_ddp_hook(model, preset_of(row), seed=seed, topology=topology), None


def worker(rank: int, world: int, task: Workload, row: str, steps: int, batch: int, rule: UpdateRule,
           seed: int, device_name: str = "cpu", nodes: int = 1) -> dict[str, Any]:
    """One rank's training run for one row: a sparsecomm preset (or spec) through its DDP hook —
    flat, or over ``nodes`` nodes when the row is `HIERARCHICAL` —, under FSDP2 (`sharded`), or one
    of PyTorch's own schemes (`BASELINES`, `SHARDED_BASELINES`)."""
    device = worker_device(device_name, rank)
    compute_per_step = compute_seconds_per_step(task, batch, seed, device=device, rule=rule)
    model, reducer, meter = _wrapped(row, task.model(seed).to(device), world, nodes, seed, ddp_options(task))
    counted = meter if meter is not None else reducer.stats if reducer is not None else None
    assert counted is not None, "every row counts its bytes: a meter or a reducer's stats"
    optimizer, suited = rule.build(model, reducer)  # one update rule for every row
    schedule = rule.schedule(optimizer, steps)
    losses, cumulative_bytes, elapsed = [], [], []
    on_link = nodes > 1 and steps > 1 and bytes_sent_here() is not None  # the link between nodes: count it
    link_start = 0
    start = time.perf_counter()
    for number, batch_data in enumerate(task.batches(rank, world, steps, batch, seed)):
        if number == 1 and on_link:  # counted from the second step: set-up (DDP's broadcast) is done
            dist.barrier()
            link_start = bytes_sent_here() or 0
        optimizer.zero_grad()
        loss = task.loss(model, on_device(batch_data, device))
        loss.backward()  # the hook's local stages run here, its collectives on their own thread
        with identical_update() if device.type == "cuda" else nullcontext():
            optimizer.step()
        if schedule is not None:
            schedule.step()
        # reading the loss copies it to the host after the step's queued kernels: on a GPU it waits for them
        losses.append(float(loss.detach()))
        if meter is not None:
            meter.step()
        cumulative_bytes.append(counted.bytes_sent)
        elapsed.append(time.perf_counter() - start)
    wall_s = time.perf_counter() - start
    link_bytes = None
    if on_link:
        dist.barrier()
        link_bytes = (bytes_sent_here() or 0) - link_start if rank % (world // nodes) == 0 else 0
    if not task.ddp_broadcast_buffers:
        average_buffers(model)
    evaluation = task.evaluate(getattr(model, "module", model))
    adaptive: dict[str, Any] = {}
    if reducer is None:
        summary = {"select_s": 0.0, "transport_s": 0.0, "decode_s": 0.0, "bytes_per_step": cumulative_bytes[-1] / steps}
    else:
        summary = reducer.stats.summary()
        if reducer.adaptive is not None:
            planner, costs = reducer.adaptive.planner, reducer.adaptive.planner.costs
            adaptive["mode_steps"] = {str(mode): count for mode, count in planner.mode_steps.items()}
            # the route its sparse steps settled on: what such a step cost beyond its wire time, and its
            # bytes per nonzero (for projections)
            route = Mode.DEVICE if planner.trials.incumbent is Mode.DEVICE else Mode.SPARSE
            if costs.overhead_s(route):
                per_nnz, fixed = costs.payload_bytes(route)
                adaptive |= {"sparse_route": str(route), "sparse_overhead_s": min(costs.overhead_s(route)),
                             "bytes_per_nnz": per_nnz, "fixed_bytes": fixed}
            if costs.preferred_density:
                adaptive["sparse_density"] = statistics.median(costs.preferred_density)
        reducer.close()
    numel = sum(p.numel() for p in model.parameters())
    sparse_bytes = None  # what its sparse gradients' streams sent per step (the node projection splits them off)
    if reducer is not None and (sparse := sparse_rows.sparse_parameters(model)):
        streams = reducer.stats.tensors
        sparse_bytes = sum(streams[name].bytes_sent for name in sparse if name in streams) / steps
    return {
        "losses": losses, "cumulative_bytes": cumulative_bytes, "elapsed_s": elapsed, "wall_s": wall_s,
        "select_s": summary["select_s"], "transport_s": summary["transport_s"], "decode_s": summary["decode_s"],
        # what the wall time holds beyond compute, encode and decode: communication the step waited for
        "communicate_wait_s": max(0.0, wall_s - compute_per_step * steps - summary["select_s"] - summary["decode_s"]),
        # measured without communication: forward + backward + step of the bare model, times the steps
        "compute_s": compute_per_step * steps,
        "bytes_per_step": summary["bytes_per_step"], "metric": evaluation.metric,
        "test_loss": evaluation.loss, "parameters": numel, "adaptive": adaptive,
        "suited_spec": None if suited is None or reducer is None else format_spec(reducer.spec),
        "link_bytes": link_bytes, "sparse_bytes_per_step": sparse_bytes,
        "digest": hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                          for p in sharded.full_parameters(model))).hexdigest(),
    }


def reference_row(names: list[str]) -> str | None:
    """The row others are measured against: DDP's plain allreduce when it runs, else ``dense``."""
    return next((name for name in ("torch-allreduce", "dense") if name in names), None)


def run(workload: str | Workload, presets: list[str], workers: int, steps: int, batch: int | None = None,
        lr: float | None = None, seed: int = 0, bandwidth: str = "1gbit", namespaces: list[str] | None = None,
        target_loss: float | None = None, device: str = "cpu",
        done: Callable[[str], None] | None = None, optimizer: str | None = None,
        nodes: int = 1) -> dict[str, Any]:
    """Train with each row — a preset, a spec, or one of PyTorch's schemes (`BASELINES`); rows carry
    the final metric, bytes, the time split and the time to ``target_loss`` (default: where the
    reference row, `reference_row`, has made 95% of its improvement), measured and modeled. A
    baseline that cannot run on this workload is a row saying why. ``device``: where each rank
    trains (`worker_device`); ``done(row)`` is called as each row ends (a progress bar). ``batch``,
    ``lr`` and ``optimizer`` default to the workload's (`UpdateRule`). `HIERARCHICAL` and FSDP2
    rows lay the ranks out on ``nodes`` nodes; on a shaped network of several nodes, each row
    reports the bytes that crossed the link per step."""
    link = bits_per_second(bandwidth)
    check_device(device)  # fail before starting any worker
    task = load_workload(workload) if isinstance(workload, str) else workload  # handed to every worker
    workload_name = task.name
    rule = UpdateRule.of(task, optimizer, lr)
    batch = task.default_batch if batch is None else batch
    for preset in presets:
        if preset not in BASELINES and preset not in SHARDED_BASELINES:
            resolve(preset_of(preset))  # fail before starting any worker
    if workers % nodes:
        raise SparseCommError(f"{workers} workers do not fill {nodes} nodes of equal size")
    sparse_gradients = has_sparse_gradients(task.model(seed))
    sparse_part = sparse_rows.record(task, batch, seed) if sparse_gradients else None
    refused = {name: why for name in presets if name in BASELINES
               and (why := BASELINES[name].why_not(sparse_gradients)) is not None}
    refused |= {name: f"{name} cannot run here: FSDP2 takes dense gradients only"
                for name in presets if is_sharded(name) and sparse_gradients}
    rows: list[dict[str, Any]] = []
    curves: dict[str, dict[str, Any]] = {}
    in_job = launched_by_torchrun()
    joined_here = in_job and not dist.is_initialized()
    if in_job:
        workers = join_job()
    for preset in presets:
        if preset in refused:
            rows.append({"preset": preset, "workload": workload_name, "metric_name": task.metric_name,
                         "workers": workers, "steps": steps, "note": refused[preset]})
            if done is not None:
                done(preset)
            continue
        if in_job:
            results = shared_view(worker(dist.get_rank(), workers, task, preset, steps, batch, rule, seed, device,
                                         nodes))
        else:
            results = run_local(workers, worker, task, preset, steps, batch, rule, seed, device, nodes, timeout=3600,
                                namespaces=namespaces)
        first = results[0]
        identical = len({r["digest"] for r in results}) == 1
        # the mean over ranks, and the busiest rank's: the ranks of a split collective (SparCML's, the
        # global top-k) send unequal shares
        bytes_per_step = sum(r["bytes_per_step"] for r in results) / len(results)
        modeled_comm_s = steps * bytes_per_step * 8 / link
        rows.append({
            "preset": preset, "workload": workload_name, "metric_name": task.metric_name,
            "final_metric": first["metric"], "test_loss": first["test_loss"],
            "final_train_loss": sum(first["losses"][-20:]) / min(20, len(first["losses"])),
            "bytes_per_step": bytes_per_step, "bytes_per_step_max": max(r["bytes_per_step"] for r in results),
            "wall_s": max(r["wall_s"] for r in results),
            "compute_s": first["compute_s"], "encode_s": first["select_s"],
            "communicate_s": first["communicate_wait_s"],
            "decode_s": first["decode_s"], "modeled_comm_s": modeled_comm_s,
            "modeled_s": first["compute_s"] + first["select_s"] + modeled_comm_s,
            "workers": workers, "steps": steps, "ranks_identical": identical, **first["adaptive"],
        })
        if first["sparse_bytes_per_step"] is not None:  # its sparse gradients' share, for the node projection
            rows[-1]["sparse_bytes_per_step"] = sum(r["sparse_bytes_per_step"] for r in results) / len(results)
        if first["link_bytes"] is not None:  # each node's first rank counted its node's bytes
            rows[-1]["link_bytes_per_step"] = sum(r["link_bytes"] for r in results) / (steps - 1)
        if first["suited_spec"]:  # its own momentum correction would apply the optimizer's momentum twice
            rows[-1]["note"] = f"{preset} under {rule.optimizer}: error feedback in place of its momentum " \
                               f"correction ({first['suited_spec']})"
        curves[preset] = {"losses": first["losses"], "cumulative_bytes": first["cumulative_bytes"],
                          "elapsed_s": [max(times) for times in zip(*(r["elapsed_s"] for r in results), strict=True)]}
        if done is not None:
            done(preset)
    if joined_here:
        dist.barrier()
        dist.destroy_process_group()
    reference = reference_row(list(curves))
    ran = [row for row in rows if row["preset"] in curves]
    reference_bytes = next((r["bytes_per_step"] for r in ran if r["preset"] == reference), None)
    for row in ran:
        row["compression_ratio"] = (reference_bytes / row["bytes_per_step"]
                                    if reference_bytes and row["bytes_per_step"] else 1.0)
    target = target_loss if target_loss is not None else default_target(curves, reference)
    for row in ran:
        curve = curves[row["preset"]]
        step = first_step_at_or_below(smoothed(curve["losses"]), target) if target is not None else None
        row["target_loss"] = target
        row["steps_to_target"] = None if step is None else step + 1
        row["time_to_target_s"] = None if step is None else curve["elapsed_s"][step]
        row["modeled_time_to_target_s"] = None if step is None else row["modeled_s"] * (step + 1) / steps
    reference_time = next((r["time_to_target_s"] for r in ran if r["preset"] == reference), None)
    for row in ran:
        seconds = row["time_to_target_s"]
        row["speedup_to_target"] = reference_time / seconds if seconds and reference_time else None
    return {"benchmark": "train", "workload": workload_name, "workers": workers, "nodes": nodes, "steps": steps,
            "lr": rule.lr, "optimizer": rule.optimizer, "warmup_share": rule.warmup_share, "batch": batch,
            "device": device, "launcher": "torchrun" if in_job else "local", "reference": reference,
            "bandwidth": bandwidth, "target_loss": target, "rows": rows, "curves": curves,
            **({sparse_rows.FIELD: sparse_part} if sparse_part else {})}


TARGET_SLACK = 0.05


def over_seeds(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """One result from runs that differ only in seed: the first run's rows and curves, each row with
    its metric's (and its speed-up's) mean, standard deviation and per-seed values, its time to the
    target per seed and their median (each seed's target is its own reference's), and every run
    kept under ``runs``. Rows that did not run (a baseline that cannot) stay as they are."""
    result = dict(runs[0])

    def spread(index: int, field: str) -> torch.Tensor | None:
        values = [run["rows"][index].get(field) for run in runs]
        return None if any(v is None for v in values) else torch.tensor(values, dtype=torch.float64)

    reference = result.get("reference", "dense")
    metrics = [spread(i, "final_metric") for i in range(len(result["rows"]))]
    baseline = next((float(values.mean()) for row, values in zip(result["rows"], metrics, strict=True)
                     if row["preset"] == reference and values is not None), None)
    rows = []
    for index, (row, values) in enumerate(zip(result["rows"], metrics, strict=True)):
        if values is None:
            rows.append(row)
            continue
        mean = float(values.mean())
        speedups, times = spread(index, "speedup_to_target"), spread(index, "time_to_target_s")
        rows.append({**row, "final_metric_mean": mean,
                     "final_metric_std": float(values.std()) if len(values) > 1 else 0.0,
                     "final_metric_by_seed": " ".join(f"{float(v):.4g}" for v in values),
                     "metric_vs_reference": mean - baseline if baseline is not None else None,
                     "speedup_mean": float(speedups.mean()) if speedups is not None else None,
                     "speedup_std": float(speedups.std()) if speedups is not None and len(speedups) > 1 else None,
                     "time_to_target_median_s": statistics.median(times.tolist()) if times is not None else None,
                     "time_to_target_by_seed": " ".join("-" if run["rows"][index].get("time_to_target_s") is None
                                                        else f"{run['rows'][index]['time_to_target_s']:.3g}"
                                                        for run in runs)})
    result.update(rows=rows, seeds=seeds, runs=runs if len(runs) > 1 else [])
    return result


def default_workers() -> int:
    """Local workers when not told: one per core, at most 4 (more would time the scheduler)."""
    return max(1, min(4, os.cpu_count() or 1))


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (torch.distributed.run) job."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def job_layout(workers: int | None, nodes: int | None) -> tuple[int, int]:
    """(ranks, nodes) of this torchrun job, from its environment (``WORLD_SIZE``, and
    ``LOCAL_WORLD_SIZE`` ranks per node; without it, ``nodes`` or one).

    Raises:
        SparseCommError: ``workers`` or ``nodes`` given and not the job's.
    """
    world = int(os.environ["WORLD_SIZE"])
    if "LOCAL_WORLD_SIZE" not in os.environ:  # a launcher that does not say: as told
        job_nodes = Topology(world // (nodes or 1)).nodes(world)
    else:
        job_nodes = Topology.from_env().nodes(world)
    for flag, given, actual in (("--workers", workers, world), ("--nodes", nodes, job_nodes)):
        if given is not None and given != actual:
            raise SparseCommError(f"{flag} {given}: this torchrun job has {actual} (its ranks and nodes decide)")
    return world, job_nodes


def join_job() -> int:
    """Join the torchrun job's process group (gloo) if not joined yet; returns its world size."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_world_size()


def is_reporting_rank() -> bool:
    """Rank 0 of a torchrun job, or the parent of local workers."""
    return int(os.environ.get("RANK", "0")) == 0 if launched_by_torchrun() else True


def shared_view(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """What `run` needs of every rank's result, gathered as tensors (no pickling): each rank's wall
    time, bytes it counted on the link between nodes, per-step elapsed times and parameter digest;
    rank 0's full result stands first."""
    world = dist.get_world_size()
    link = math.nan if mine["link_bytes"] is None else float(mine["link_bytes"])
    numbers = torch.tensor([mine["wall_s"], link, *mine["elapsed_s"]], dtype=torch.float64)
    gathered = [torch.empty_like(numbers) for _ in range(world)]
    dist.all_gather(gathered, numbers)
    digest = torch.frombuffer(bytearray(bytes.fromhex(mine["digest"])), dtype=torch.uint8)
    digests = [torch.empty_like(digest) for _ in range(world)]
    dist.all_gather(digests, digest)
    shared = ("wall_s", "link_bytes", "elapsed_s", "digest")
    views = [{**mine, "wall_s": float(n[0]), "link_bytes": None if math.isnan(n[1]) else int(n[1]),
              "elapsed_s": n[2:].tolist(), "digest": d.numpy().tobytes().hex()}
             for n, d in zip(gathered, digests, strict=True)]
    views[0] = {**mine, **{key: views[0][key] for key in shared}}
    return views


def smoothed(losses: list[float]) -> list[float]:
    """Training loss as a trailing moving average over 1/30 of the run (one batch is noisy)."""
    window = max(1, len(losses) // 30)
    sums = torch.tensor([0.0, *losses], dtype=torch.float64).cumsum(0)
    ends = torch.arange(1, len(losses) + 1)
    starts = (ends - window).clamp_min(0)
    return ((sums[ends] - sums[starts]) / (ends - starts)).tolist()


def default_target(curves: dict[str, dict[str, list[float]]], reference: str | None = "dense") -> float | None:
    """The smoothed training loss at which the reference row has made 95% of its improvement over
    the run: a loss it reaches only late (a margin in percent of the loss would be reached early on
    a slowly flattening curve). None where it made none (a diverging run: no target to race to)."""
    if reference not in curves or not curves[reference]["losses"]:
        return None
    curve = smoothed(curves[reference]["losses"])
    if not curve[-1] < curve[0]:
        return None
    return curve[-1] + TARGET_SLACK * (curve[0] - curve[-1])


def first_step_at_or_below(values: list[float], target: float) -> int | None:
    hits = torch.nonzero(torch.tensor(values) <= target)
    return int(hits[0]) if hits.numel() else None


def plot(result: dict[str, Any], path: str) -> None:
    """Loss against step and against bytes sent, one line per preset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for preset, curve in result["curves"].items():
        smooth = smoothed(curve["losses"])
        by_step.plot(range(len(smooth)), smooth, label=preset)
        by_bytes.plot([max(b, 1) for b in curve["cumulative_bytes"]], smooth, label=preset)
    by_step.set(xlabel="step", ylabel="training loss (moving average)",
                title=f"{result['workload']}, {result['workers']} workers")
    by_bytes.set(xlabel="gradient bytes sent by one rank (log)", ylabel="training loss", xscale="log",
                 title="loss against communication")
    by_step.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
