"""Projected scaling, the analogue of DGC's Figure 6: time per step and speed-up over one worker for
P = 1…256 workers on 1, 10 and 100 Gbit/s links, for every row of a `sparsecomm train` run.

Compute, encoding and decoding are what the run measured on this machine, per step; the network is
an α-β model of how each row's bytes travel (α: seconds per message, β: seconds per byte):

- ``allreduce`` (dense, fp16, S2's sketch read by medians, PowerSGD): an all_reduce of the bytes one
  rank hands it by recursive halving and doubling (Rabenseifner, as DGC's model),
  2⌈log2 P⌉·α + 2(P−1)/P·bytes·β, once per collective it runs per step (PowerSGD: three);
- ``peeled_sketch`` (S2's sketch solved by peeling): the same all_reduce, of a sketch sized to the
  ranks' marked entries summed, so its bytes and its decoding grow as P (past the dense tensor's
  bytes at large P: the transport does not cap it);
- ``allgather`` (payload transports): every rank receives the P−1 other payloads,
  ⌈log2 P⌉·α + (P−1)·bytes·β, and decodes them: decoding time grows as P−1;
- ``sparse_allreduce`` (SparCML): recursive doubling, log2 P rounds, round t carrying the union of
  2^t ranks' selections (SparCML App. B: E[K] = N(1 − (1 − d)^m)), never more than the dense tensor;
- ``split_topk`` (``sparse_allreduce(algorithm=topk_sa)``): an all-to-all of each rank's selection
  by range, then an allgather of the owners' ⌈k/P⌉ largest sums: (P−1)·α + ⌈log2 P⌉·α +
  2(P−1)/P·S·β with S one selection's bytes, and decoding about two selections at any P;
- ``adaptive``: whichever of its modes costs least at that P and link — dense fp32, dense fp16, or
  sparse at the density its run preferred (the gradient-energy rule's pick at the measured point,
  not derived again per link: the run keeps no energy curve) but never more than β⁻¹·C/(P−1) bytes
  or a quarter of the entries, paying the overhead a
  sparse step measured beyond its wire time (O_s: half of it taken as encoding, which stays, half
  as decoding one peer's payload, which grows as P−1).

Each row is anchored at the run's own point, as DGC's model (Wen et al.) combines profiling with an
analytical network: what the run's measured median step takes beyond the model at the run's worker
count and link — the hooks' own compute, software cost per collective — stays in every projected
step. (A run on loopback has no link rate to anchor at: its rows are the bare model.)

Speed-up over one worker is P·T(1)/T(P): P workers process P batches in T(P), one worker one batch in
T(1) (its compute alone). `check` sets the projection beside other runs' measured steps — at another
link rate or worker count — and gives the error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from sparsecomm.netns import bits_per_second
from sparsecomm.presets import resolve
from sparsecomm.train.baselines import BASELINES
from sparsecomm.train.row_names import HIERARCHICAL, is_flat
from sparsecomm.train.sparse_rows import SparseRows
from sparsecomm.transport.owner_counts import owner_counts_bytes

LINKS = MappingProxyType({"1gbit": (1e9, 50e-6), "10gbit": (10e9, 20e-6), "100gbit": (100e9, 5e-6)})
"""link rate (bits/s) and a typical per-message latency α (s): TCP over Ethernet at 1 and 10 Gbit/s,
RDMA at 100 Gbit/s"""
WORKERS = tuple(2**i for i in range(9))
"""P = 1, 2, 4, …, 256"""


@dataclass(frozen=True)
class RowCosts:
    """What one row of a training run costs per step, as measured, and how its bytes travel."""

    name: str
    kind: str
    compute_s: float
    encode_s: float
    decode_s: float
    bytes_per_step: float
    dense_bytes: float
    measured_workers: int
    collectives: int = 1
    sparse_overhead_s: float | None = None
    bytes_per_nnz: float = 1.5
    sparse_density: float | None = None
    """adaptive: the density its sparse steps settled on (None: before any was preferred)"""
    unmodeled_s: float = 0.0
    """what the measured step took beyond the model at the run's own point (see the module)"""
    sparse: SparseRows | None = None
    """the gradients its model has as sparse rows, for the node projection (None: none)"""

    @classmethod
    def from_row(cls, row: dict[str, Any], dense_bytes: float, sparse: dict[str, Any] | None = None) -> RowCosts:
        """``row``'s costs; ``sparse``: its run's `sparsecomm.train.sparse_rows.FIELD`."""
        steps = row["steps"]
        kind, collectives = _travel(row["preset"])
        return cls(row["preset"], kind, row["compute_s"] / steps, row["encode_s"] / steps, row["decode_s"] / steps,
                   row["bytes_per_step"], dense_bytes, row["workers"], collectives, row.get("sparse_overhead_s"),
                   row.get("bytes_per_nnz", 1.5), row.get("sparse_density"), sparse=SparseRows.of(sparse, row))

    def step_s(self, workers: int, rate_bps: float, alpha: float) -> float:
        """Projected seconds per step at ``workers`` on a link of ``rate_bps`` and latency ``alpha``."""
        if workers == 1:
            return self.compute_s
        return self.modeled_s(workers, rate_bps, alpha) + self.unmodeled_s

    def modeled_s(self, workers: int, rate_bps: float, alpha: float) -> float:
        """The α-β model alone (no anchoring)."""
        beta = 8 / rate_bps
        if self.kind == "adaptive":
            modes = [self._allreduce(workers, self.dense_bytes, beta, alpha),
                     self._allreduce(workers, self.dense_bytes / 2, beta, alpha)]
            if self.sparse_overhead_s is not None:
                modes.append(self._sparse_at_budget(workers, beta, alpha))
            return min(modes)
        if self.kind == "allreduce":
            return self.compute_s + self.encode_s + self.decode_s + self.collectives * _allreduce_time(
                workers, self.bytes_per_step, beta, alpha)
        if self.kind == "peeled_sketch":
            decode_s, nbytes = self.peeled_sketch(workers)
            return self.compute_s + self.encode_s + decode_s + _allreduce_time(workers, nbytes, beta, alpha)
        if self.kind == "split_topk":
            return (self.compute_s + self.encode_s + self.decode_s + (workers - 1 + _rounds(workers)) * alpha
                    + (2 * (workers - 1) / workers * self.selection_bytes() + owner_counts_bytes(workers)) * beta)
        if self.kind == "sparse_allreduce":
            return self.compute_s + self.encode_s + self.decode_s + _recursive_doubling(
                workers, self.bytes_per_step, self.dense_bytes, beta, alpha)
        return (self.compute_s + self.encode_s + self._decode(workers)
                + _rounds(workers) * alpha + (workers - 1) * self.bytes_per_step * beta)

    def selection_bytes(self) -> float:
        """``split_topk``: one rank's selection, from what a rank sent at the run's P (2(P−1)/P of it,
        and its owner's counts to the P − 1 others)."""
        measured = self.measured_workers
        sent = max(0.0, self.bytes_per_step - owner_counts_bytes(measured))
        return sent * measured / max(1, 2 * (measured - 1))

    def peeled_sketch(self, workers: int) -> tuple[float, float]:
        """A peeled sketch's (decode seconds, bytes) at ``workers``: sized to every rank's selection,
        both grow as the ranks do."""
        grown = workers / self.measured_workers
        return self.decode_s * grown, self.bytes_per_step * grown

    def _decode(self, workers: int) -> float:
        return self.decode_s * (workers - 1) / max(1, self.measured_workers - 1)

    def _allreduce(self, workers: int, nbytes: float, beta: float, alpha: float) -> float:
        return self.compute_s + _allreduce_time(workers, nbytes, beta, alpha)

    def _sparse_at_budget(self, workers: int, beta: float, alpha: float) -> float:
        """adaptive's sparse mode: the run's preferred density, but no more bytes than the link
        carries while the step computes nor a quarter of the entries, plus the overhead its sparse
        steps measured (see the module)."""
        assert self.sparse_overhead_s is not None
        entries = self.dense_bytes / 4
        budget = min(self.compute_s / beta / (workers - 1), entries / 4 * self.bytes_per_nnz)
        if self.sparse_density is not None:
            budget = min(budget, self.sparse_density * entries * self.bytes_per_nnz)
        peers = (workers - 1) / max(1, self.measured_workers - 1)
        overhead = self.sparse_overhead_s / 2 * (1 + peers)
        return self.compute_s + overhead + _rounds(workers) * alpha + (workers - 1) * budget * beta

    def speedup(self, workers: int, rate_bps: float, alpha: float) -> float:
        return workers * self.compute_s / self.step_s(workers, rate_bps, alpha)


def _rounds(workers: int) -> int:
    return math.ceil(math.log2(workers))


def _allreduce_time(workers: int, nbytes: float, beta: float, alpha: float) -> float:
    """Recursive halving and doubling: the ring's bytes in logarithmically many rounds."""
    return 2 * _rounds(workers) * alpha + 2 * (workers - 1) / workers * nbytes * beta


def _recursive_doubling(workers: int, nbytes: float, dense_bytes: float, beta: float, alpha: float) -> float:
    density = min(1.0, nbytes / dense_bytes)
    total, members = 0.0, 1
    for _ in range(math.ceil(math.log2(workers))):
        union = 1 - (1 - density) ** members
        total += alpha + min(union * dense_bytes, dense_bytes) * beta
        members *= 2
    return total


def _travel(row: str) -> tuple[str, int]:
    """(how a row's bytes travel, collectives per step)."""
    if row in BASELINES:
        return "allreduce", 3 if BASELINES[row].powersgd_rank else 1
    spec = resolve(row)
    transport = spec.transport.name
    if spec.sparsifier.name == "adaptive":
        return "adaptive", 1
    if getattr(spec.transport, "decode", None) == "peel":
        return "peeled_sketch", 1
    if getattr(spec.transport, "algorithm", None) == "topk_sa":
        return "split_topk", 1
    return {"dense": "allreduce", "sketch_allreduce": "allreduce",
            "sparse_allreduce": "sparse_allreduce"}.get(transport, "allgather"), 1


def project(result: dict[str, Any], links: Mapping[str, tuple[float, float]] | None = None,
            workers: tuple[int, ...] = WORKERS, others: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per row, link and worker count: projected ms per step and speed-up over one worker; with
    ``others`` (runs of the same workload elsewhere), the projection checked against them."""
    links = links or LINKS
    costs = anchored(result)
    points = [{"preset": c.name, "link": link, "workers": p, "ms": 1e3 * c.step_s(p, rate, alpha),
               "speedup": c.speedup(p, rate, alpha)}
              for c in costs for link, (rate, alpha) in links.items() for p in workers]
    return {"benchmark": "scaling", "workload": result["workload"], "anchor": result.get("link"),
            "links": {k: list(v) for k, v in links.items()}, "workers": list(workers), "points": points,
            "check": [row for other in others or [] for row in check(costs, other)]}


def anchored(result: dict[str, Any]) -> list[RowCosts]:
    """Each ran row's costs, anchored at the run's own point when it ran on a link of known rate."""
    dense = dense_bytes(result)
    costs = [RowCosts.from_row(row, dense) for row in flat_rows(result)]
    point = run_link(result)
    if point is None:
        return costs
    rate, alpha = point
    return [replace(cost, unmodeled_s=max(0.0, median_step_s(result, cost.name)
                                         - cost.modeled_s(result["workers"], rate, alpha))) for cost in costs]


def dense_bytes(result: dict[str, Any]) -> float:
    """What a dense all_reduce sends per rank and step: DDP's row's bytes (or ``dense``'s)."""
    return max(row["bytes_per_step"] for row in flat_rows(result) if row["preset"] in ("torch-allreduce", "dense"))


def flat_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows that ran with every rank a peer: not hierarchical, not under FSDP2."""
    return [row for row in result["rows"] if "bytes_per_step" in row and is_flat(row["preset"])]


def check(costs: list[RowCosts], other: dict[str, Any]) -> list[dict[str, Any]]:
    """The projection beside ``other``'s measured median steps, at its worker count and link."""
    point = run_link(other)
    if point is None:
        return []
    rate, alpha = point
    rows = []
    for cost in costs:
        if cost.name not in other.get("curves", {}):
            continue
        measured, modeled = median_step_s(other, cost.name), cost.step_s(other["workers"], rate, alpha)
        rows.append({"preset": cost.name, "workers": other["workers"], "link": other["link"],
                     "measured_ms": 1e3 * measured, "projected_ms": 1e3 * modeled,
                     "error_pct": 100 * (modeled - measured) / measured})
    return rows


def median_step_s(result: dict[str, Any], name: str) -> float:
    elapsed = result["curves"][name]["elapsed_s"]
    steps = sorted(b - a for a, b in zip([0.0, *elapsed], elapsed, strict=False))
    return steps[len(steps) // 2]


def run_link(result: dict[str, Any]) -> tuple[float, float] | None:
    """(rate, α) of the link a run trained on, if it was a shaped one (None: loopback or a torchrun
    job's own network)."""
    link = result.get("link", "")
    if not link or not link[0].isdigit():
        return None
    return bits_per_second(link), LINKS["1gbit"][1]


def table(projection: dict[str, Any], workers: tuple[int, ...] = (8, 64, 256)) -> list[dict[str, Any]]:
    """One row per preset: speed-up over one worker at ``workers`` on each link."""
    rows: dict[str, dict[str, Any]] = {}
    for point in projection["points"]:
        if point["workers"] in workers:
            rows.setdefault(point["preset"], {"preset": point["preset"]})[
                f"{point['link']} P={point['workers']}"] = point["speedup"]
    return list(rows.values())


def plot(projection: dict[str, Any], path: str) -> None:
    """Speed-up over one worker against P, one panel per link, one line per row (DGC's Figure 6)."""
    workers = projection["workers"]
    panels = []
    for link in projection["links"]:
        by_row: dict[str, list[tuple[int, float]]] = {}
        for point in projection["points"]:
            if point["link"] == link:
                by_row.setdefault(point["preset"], []).append((point["workers"], point["speedup"]))
        panels.append(Panel(f"{projection['workload']}, {link}", by_row, workers, workers))
    plot_panels(panels, "workers", "speed-up over one worker (projected)", path)


@dataclass(frozen=True)
class Panel:
    """One panel of a speed-up plot: a line per row over ``ticks``, and the linear speed-up."""

    title: str
    lines: dict[str, list[tuple[int, float]]]
    ticks: list[int]
    linear: list[int]


def plot_panels(panels: list[Panel], xlabel: str, ylabel: str, path: str) -> None:
    """Panels side by side on log-log axes sharing y; a ``hier:`` row's line dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True)
    for axis, panel in zip(axes, panels, strict=True):
        for preset, series in panel.lines.items():
            axis.plot([x for x, _ in series], [y for _, y in series], marker=".", label=preset,
                      linestyle="--" if preset.startswith(HIERARCHICAL) else "-")
        axis.plot(panel.ticks, panel.linear, color="grey", linestyle=":", label="linear")
        axis.set(xscale="log", yscale="log", xlabel=xlabel, title=panel.title)
        axis.set_xticks(panel.ticks, [str(tick) for tick in panel.ticks])
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
