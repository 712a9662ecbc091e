"""``sparsecomm bench collectives``: time per operation of every transport next to dense all_reduce
and plain allgather, on loopback or a shaped link, with each measurement's ratio to the floor (its
parts: latency, information-bound wire bytes, the output pass — α, β and the pass measured in the
same run), to Ok-Topk's sparse-allreduce bound, and the model's prediction; with ``profile``, the
time of each phase of a call (`PHASES`)."""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.bench.bounds import subset_bits
from sparsecomm.bench.calibration import calibrate_group
from sparsecomm.encode.base import INDEX_CODECS, VALUE_CODECS
from sparsecomm.host_memory import clear_
from sparsecomm.launch import run_local
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.spec import parse_spec
from sparsecomm.transport.auto import choose, estimated_payload_bytes_per_nnz, exploring_calls
from sparsecomm.transport.base import Transport
from sparsecomm.transport.cost_model import INDEX_BYTES, CostModel
from sparsecomm.transport.request import PHASES, CallRecord, Request
from sparsecomm.transport.session import TransportSession

DEFAULT_TRANSPORTS = [
    "dense", "allgather", "sparse_allreduce(algorithm=ssar_rd)", "sparse_allreduce(algorithm=ssar_sa)",
    "sparse_allreduce(algorithm=dsar_sa)", "sparse_allreduce(algorithm=dsar_sa,qsgd_bits=4)",
    "sparse_allreduce(algorithm=topk_sa)", "sketch_allreduce", "auto(explore=0)", "auto",
]


def contribution(rank: int, numel: int, density: float, seed: int) -> SparseGradient:
    """This rank's sparse gradient: uniform random positions, normal values."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    nnz = max(1, round(numel * density))
    indices = torch.randperm(numel, generator=generator)[:nnz]
    return SparseGradient(indices, torch.randn(nnz, generator=generator), torch.Size([numel]))


def floor(model: CostModel, workers: int, numel: int, nnz: int, output_pass_s: float,
          isize: int = 4) -> dict[str, float]:
    """The least time, in seconds, a call that sums ``nnz`` random entries per rank can take, by part:
    ``latency``, ⌈log2 P⌉ messages; ``wire``, each rank receiving the (P−1)/P of the result it does
    not own at the information bound (log2 C(N, K) bits for the K = E[union] positions, plus their
    values; dense when that is smaller); ``output``, one pass writing the result into a
    preallocated N-vector, as timed in the same rounds as the calls."""
    if workers == 1:
        return {"latency": 0.0, "wire": 0.0, "output": output_pass_s}
    union = round(model.expected_union(numel, nnz, workers))
    result_bytes = min(subset_bits(numel, union) / 8 + union * isize, numel * isize)
    return {"latency": math.ceil(math.log2(workers)) * model.alpha,
            "wire": (workers - 1) / workers * result_bytes * model.beta, "output": output_pass_s}


def split_floor(model: CostModel, workers: int, nnz: int, output_pass_s: float, isize: int = 4) -> float:
    """Ok-Topk's lower bound (PPoPP'22) for a sparse allreduce of k = ``nnz`` entries per rank, in
    seconds: two messages, 2k(P−1)/P (index, value) pairs through each rank, and the output pass."""
    if workers == 1:
        return output_pass_s
    pairs = 2 * nnz * (workers - 1) / workers
    return 2 * model.alpha + pairs * (INDEX_BYTES + isize) * model.beta + output_pass_s


OUTPUT_PASS = "output pass"
"""the floor's memory part, timed as one more contender in every round: the pass and the calls
then see the same spells of a shared machine's memory traffic (timed once apart from the rounds,
the pass varies from run to run where the calls do not)"""


def timed_output_pass(out: torch.Tensor) -> float:
    """Milliseconds of one pass that clears ``out`` on every rank at once, as a call's output is
    cleared (the slowest rank's time, on every rank): the part of every call's floor that is
    memory, not wire."""
    dist.barrier()
    start = time.perf_counter()
    clear_(out)
    slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return 1e3 * float(slowest)


def predicted(model: CostModel, text: str, workers: int, numel: int, nnz: int, request: Request) -> float:
    transport = parse_spec(text).transport
    name = transport.name
    if name == "dense":
        return model.dense(workers, numel)
    if name == "allgather":
        return model.allgather(workers, numel, nnz, estimated_payload_bytes_per_nnz(request, numel, nnz))
    if name == "sketch_allreduce":
        return model.sketch(workers, numel, nnz, transport.ratio, transport.block,  # type: ignore[attr-defined]
                            transport.rows, transport.decode)  # type: ignore[attr-defined]
    if name == "auto":
        best, costs = choose(model, workers, numel, nnz, 4, request)
        return costs[best]  # the model's first choice
    algorithms = model.sparse_algorithms(workers, numel, nnz, 4, transport.qsgd_bits)  # type: ignore[attr-defined]
    algorithm = transport.algorithm  # type: ignore[attr-defined]
    if algorithm == "topk_sa":
        return model.split_allgather(workers, numel, nnz, 4, keep=True)
    return algorithms[algorithm] if algorithm != "auto" else min(algorithms.values())


def timed_call(transport: Transport, grad: SparseGradient, request: Request, out: torch.Tensor,
               session: TransportSession, profile: bool = False) -> tuple[list[float], torch.Tensor, CallRecord]:
    """The slowest rank's time (ms) of one call into a reused ``out``, on every rank — followed,
    with ``profile``, by the slowest rank's time in each of `PHASES`."""
    dist.barrier()
    start = time.perf_counter()
    reduction = transport.reduce(grad, request=request, out=out, session=session)
    phases = [time.perf_counter() - start]
    if profile:
        phases += [reduction.record.phases.get(phase, 0.0) for phase in PHASES]
    slowest = torch.tensor(phases, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [1e3 * t for t in slowest.tolist()], reduction.total, reduction.record


CONTENDER_FACTOR = 2.0
EXTRA_ROUNDS_BUDGET_S = 10.0
MAX_ROUNDS_FACTOR = 20


def close_contenders(medians: dict[str, float], built: dict[str, Transport]) -> list[str]:
    """The transports within `CONTENDER_FACTOR` of the fastest, and ``auto`` always: where a
    ranking is close, and auto's choice matters, they get more rounds (below). Single calls of
    5–15 ms on a shaped link vary by ±50%: 15 samples cannot order transports 10% apart."""
    fastest = min(medians.values())
    return [text for text, ms in medians.items() if ms <= CONTENDER_FACTOR * fastest or built[text].name == "auto"]


def extra_rounds(contenders: list[str], samples: dict[str, list[float]], repeat: int) -> int:
    """Rounds of only the contenders after the first ``repeat`` rounds of all: as many as fit in
    `EXTRA_ROUNDS_BUDGET_S`, up to `MAX_ROUNDS_FACTOR` × ``repeat`` rounds in all. Derived from the
    slowest rank's times, so equal on every rank."""
    round_s = sum(statistics.median(samples[text]) for text in contenders) / 1e3
    fitting = int(EXTRA_ROUNDS_BUDGET_S / max(round_s, 1e-9))
    return max(0, min(fitting, (MAX_ROUNDS_FACTOR - 1) * repeat))


def warm_up(transport: Transport, grad: SparseGradient, request: Request, out: torch.Tensor,
            session: TransportSession) -> None:
    """One untimed call — and, for ``auto``, the calls it spends exploring, so what is timed is its
    steady state, as in a training loop. They run as the timed calls do (after a barrier, into the
    same reused ``out``): auto's trials must see what the timed calls will see, or it tunes for
    conditions that are gone (a fresh 4·N-byte result each call, say)."""
    for _ in range(exploring_calls(transport) + 1):
        timed_call(transport, grad, request, out, session)


def worker(rank: int, world: int, numel: int, densities: list[float], transports: list[str], repeat: int,
           index_codec: str, value_codec: str, seed: int, profile: bool) -> dict[str, Any]:
    model = calibrate_group(rank, world)
    with TransportSession(model) as session:
        return {"rows": measure(rank, world, numel, densities, transports, repeat, index_codec, value_codec, seed,
                                model, session, profile), "model": model.__dict__}


def measure(rank: int, world: int, numel: int, densities: list[float], transports: list[str], repeat: int,
            index_codec: str, value_codec: str, seed: int, model: CostModel,
            session: TransportSession, profile: bool = False) -> list[dict[str, Any]]:
    """One table row per transport and density."""
    rows: list[dict[str, Any]] = []
    for density in densities:
        grad = contribution(rank, numel, density, seed)
        reference = grad.to_dense()
        dist.all_reduce(reference)
        scale = float(reference.abs().max())
        built = {text: parse_spec(text).transport for text in transports}
        request = Request(key=f"density {density}", seed=seed, index_codec=INDEX_CODECS.parse(index_codec),
                          value_codec=VALUE_CODECS.parse(value_codec))
        bytes_sent = dict.fromkeys(transports, 0)
        chosen = dict.fromkeys(transports, "")
        out = torch.empty(numel)  # one result buffer, reused: no transport pays for a fresh 4·N bytes
        for transport in built.values():
            warm_up(transport, grad, request, out, session)
        samples: dict[str, list[float]] = {text: [] for text in [*transports, OUTPUT_PASS]}
        phase_samples: dict[str, list[list[float]]] = {text: [] for text in transports}
        errors: dict[str, float] = {}

        names, rounds = list(built), range(repeat)
        for phase in ("every transport", "close contenders"):
            if phase == "close contenders":
                names = close_contenders({text: statistics.median(samples[text]) for text in built}, built)
                rounds = range(repeat, repeat + extra_rounds(names, samples, repeat))
            for round_index in rounds:
                # every transport (and the output pass) once per round, so slow spells hit all alike;
                # in a fresh order each round (the same on every rank), so none always runs right
                # after the same heavy one, whose freed memory and cold caches the next call pays for
                for text in random.Random(round_index).sample([*names, OUTPUT_PASS], len(names) + 1):
                    if text == OUTPUT_PASS:
                        samples[text].append(timed_output_pass(out))
                        continue
                    times, result, record = timed_call(built[text], grad, request, out, session, profile)
                    samples[text].append(times[0])
                    phase_samples[text].append(times[1:])
                    bytes_sent[text] += record.bytes_sent
                    chosen[text] = record.transport
                    errors[text] = float((result - reference).abs().max()) / max(scale, 1e-30)
        output_pass_s = statistics.median(samples[OUTPUT_PASS]) / 1e3
        measured: dict[str, float] = {}
        for text, transport in built.items():
            error = errors[text]
            ms = statistics.median(samples[text])
            sent = torch.tensor([bytes_sent[text] / len(samples[text])])
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            measured[text] = ms
            parts = floor(model, world, numel, grad.nnz, output_pass_s)
            profiled = ({phase: statistics.median(sample[i] for sample in phase_samples[text])
                         for i, phase in enumerate(PHASES)} if profile else {})
            rows.append({
                "transport": transport.to_spec(), "algorithm": chosen[text], "workers": world, "numel": numel,
                "density": density, "ms": ms, "samples": len(samples[text]),
                "predicted_ms": 1e3 * predicted(model, text, world, numel, grad.nnz, request),
                "bound_ms": 1e3 * sum(parts.values()), "output_pass_samples": len(samples[OUTPUT_PASS]),
                **{f"bound_{part}_ms": 1e3 * t for part, t in parts.items()},
                "split_bound_ms": 1e3 * split_floor(model, world, grad.nnz, output_pass_s),
                "bytes_sent_per_rank": int(sent), "max_rel_error": error, "exact": error <= 1e-5,
                **({"phases_ms": profiled} if profile else {}),
            })
        for row in rows[-len(transports):]:
            row["dense_ms"] = measured.get("dense", float("nan"))
            row["allgather_ms"] = measured.get("allgather", float("nan"))
            row["speedup_vs_dense"] = row["dense_ms"] / row["ms"] if row["ms"] > 0 else float("inf")
            row["ratio_to_bound"] = row["ms"] / row["bound_ms"] if row["bound_ms"] > 0 else float("nan")
            row["ratio_to_split_bound"] = row["ms"] / row["split_bound_ms"] if row["split_bound_ms"] > 0 else (
                float("nan"))
    return rows


def run(workers: list[int], numel: int, densities: list[float], transports: list[str] | None = None,
        repeat: int = 3, shaped: str | None = None, index_codec: str = "rice", value_codec: str = "fp32",
        seed: int = 0, timeout: float = 1800.0, profile: bool = False) -> dict[str, Any]:
    transports = transports or DEFAULT_TRANSPORTS
    for text in transports:
        parse_spec(text)  # fail before starting processes
    for required in ("dense", "allgather"):
        if required not in transports:
            transports = [required, *transports]
    rows, models = [], {}
    for world in workers:
        args = (numel, densities, transports, repeat, index_codec, value_codec, seed, profile)
        if shaped:
            from sparsecomm.netns import ShapedNetwork

            with ShapedNetwork(world, shaped) as network:
                result = run_local(world, worker, *args, timeout=timeout, namespaces=network.namespaces)[0]
        else:
            result = run_local(world, worker, *args, timeout=timeout)[0]
        rows += result["rows"]
        models[world] = result["model"]
    return {"benchmark": "collectives", "numel": numel, "densities": densities, "shaped": shaped or "loopback",
            "repeat": repeat, "index_codec": index_codec, "value_codec": value_codec, "profile": profile,
            "cost_models": models,
            "rows": rows}
