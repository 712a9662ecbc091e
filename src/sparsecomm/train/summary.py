"""What `sparsecomm train` says around its tables: before training, one line on what it is about to
show and about how long it takes; at the end, the one-line verdict for the link it trained on and
the line that puts its winner to work."""

from __future__ import annotations

from typing import Any

from sparsecomm.train.baselines import BASELINES
from sparsecomm.train.row_names import FLAT_FSDP, FSDP, HIERARCHICAL, SHARDED_BASELINES, preset_of

ROW_START_S = 2.6
"""seconds a row costs beyond its steps — starting the workers, building the model and the reducer,
evaluating — on 2 CPU cores (the default digits job: its wall time less its rows' training times,
per row)"""

DENSE_ROWS = ("dense", "torch-allreduce")
"""rows that send every gradient in fp32: the estimate gives them the link's time per step"""


def estimate_seconds(rows: list[str], seeds: int, steps: int, compute_s: float, dense_bytes: int,
                     link_bps: float | None) -> float:
    """About how long training ``rows`` takes: each row starts workers and trains ``steps``; a dense
    row's step waits for its bytes on the link (``None``: loopback, nearly free), a compressed row's
    for its compute and encoding (about twice the compute, as measured on digits and lm)."""
    dense_step = compute_s + (dense_bytes * 8 / link_bps if link_bps else 0.0)
    per_seed = sum(ROW_START_S + steps * (dense_step if row in DENSE_ROWS else 2 * compute_s) for row in rows)
    return seeds * per_seed


def intro(workload: str, rows: list[str], seeds: int, steps: int, workers: int, link: str, seconds: float) -> str:
    """The line printed before training: what the tables will show, and about how long it takes."""
    minutes = f"about {round(seconds / 30) / 2:g} min" if seconds >= 90 else f"about {seconds:.0f} s"
    ours = [row for row in rows if not _pytorchs(row) and preset_of(row) not in DENSE_ROWS]
    hooks = [row for row in rows if _pytorchs(row) and row not in DENSE_ROWS]
    contenders = f"{len(ours)} sparsecomm preset{'s' * (len(ours) != 1)}"
    if hooks:
        kinds = "DDP hooks" if all(row in BASELINES for row in hooks) else "DDP hooks and FSDP2 layouts"
        contenders += f" and {len(hooks)} of PyTorch's {kinds}"
    return (f"sparsecomm train: which of {contenders} reaches the target loss first next to a dense allreduce, "
            f"{workers} workers training {workload} for {steps} steps on {link}"
            f"{f' ({seeds} seeds)' if seeds > 1 else ''} — {minutes} here")


def _pytorchs(row: str) -> bool:
    """Whether a row is one of PyTorch's own (a DDP hook or an FSDP2 layout)."""
    return row in BASELINES or row in SHARDED_BASELINES


def verdict(result: dict[str, Any]) -> str:
    """One line: the fastest sparsecomm row to the target loss, against DDP's allreduce and the best
    of PyTorch's hooks, on the link trained on — or why there is no winner to name."""
    link = result["link"]
    reached = _reached(result)
    hooks = {name: s for name, s in reached.items() if _pytorchs(name) and name != "torch-allreduce"}
    plain_row = "torch-allreduce" if "torch-allreduce" in reached else "dense"
    plain = reached.get(plain_row)
    best = _fastest(reached)
    if best is None:
        return f"verdict on {link}: no sparsecomm row reached the target loss in {result['steps']} steps"
    metrics = {row["preset"]: row.get("final_metric_mean", row.get("final_metric")) for row in result["rows"]}
    said = [f"verdict on {link}: {best} reached the target loss in {reached[best]:.3g} s"]
    if plain is not None:
        against = "DDP's allreduce" if plain_row == "torch-allreduce" else "the dense preset"
        said.append(f"{plain / reached[best]:.3g}x as fast as {against} ({plain:.3g} s)")
    if hooks:
        hook = min(hooks, key=hooks.__getitem__)
        said.append(f"{hooks[hook] / reached[best]:.3g}x as fast as the best PyTorch hook "
                    f"({hook}, {hooks[hook]:.3g} s)")
    name = result["rows"][0].get("metric_name", "metric")
    if metrics.get(best) is not None and metrics.get("dense") is not None:
        said.append(f"{name} {metrics[best]:.4g} against dense's {metrics['dense']:.4g}")
    if plain is not None and plain < reached[best]:
        said.append("compression does not pay on this link")
    return ", ".join(said)


def usage(result: dict[str, Any]) -> str:
    """The line that puts the verdict's row to work: its preset or spec, registered as its row
    reduced (``adaptive`` through DDP's hook where no row reached the target)."""
    best = _fastest(_reached(result)) or "adaptive"
    spec = preset_of(best)
    if best.startswith((FSDP, FLAT_FSDP)):
        return (f'use it: sparsecomm.register_fsdp_hooks(model, "{spec}", mesh) on every rank, after fully_shard, '
                "before the first step")
    topology = ", topology=sparsecomm.Topology.from_env()" if best.startswith(HIERARCHICAL) else ""
    return f'use it: sparsecomm.register_ddp_hook(ddp_model, "{spec}"{topology}) on every rank, before the first step'


def _reached(result: dict[str, Any]) -> dict[str, float]:
    """Each row that reached the target, and when."""
    times = {row["preset"]: _time_to_target(row) for row in result["rows"]}
    return {name: seconds for name, seconds in times.items() if seconds is not None}


def _fastest(reached: dict[str, float]) -> str | None:
    """The sparsecomm row that reached the target first (None: none did)."""
    ours = {name: seconds for name, seconds in reached.items()
            if not _pytorchs(name) and preset_of(name) not in DENSE_ROWS}
    return min(ours, key=ours.__getitem__) if ours else None


def _time_to_target(row: dict[str, Any]) -> float | None:
    """The row's time to the target: the median over its seeds (None where a seed missed it)."""
    if "time_to_target_median_s" in row:
        return row["time_to_target_median_s"]
    return row.get("time_to_target_s")
