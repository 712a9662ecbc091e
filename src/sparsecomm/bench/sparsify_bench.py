"""``sparsecomm bench sparsify``: every sparsifier next to torch.topk and one memory pass."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from sparsecomm.bench.sources import make_gradient
from sparsecomm.bench.timing import time_ms
from sparsecomm.sparsify.base import SPARSIFIERS, count_from


def default_sparsifiers(density: float, threshold: float) -> list[str]:
    return [
        f"topk(ratio={density!r})",
        f"dgc(ratio={density!r})",
        f"randomk(ratio={density!r})",
        f"threshold(value={threshold!r})",
        f"block_topk(ratio={density!r})",
        f"bucketed_topk(ratio={density!r})",
    ]


def run(numel: int, density: float, source: str = "normal", repeat: int = 5, seed: int = 0,
        sparsifiers: list[str] | None = None, device: str = "cpu") -> dict[str, Any]:
    """Every sparsifier on one gradient of ``numel`` on ``device``, next to torch.topk there."""
    grad = make_gradient(source, numel, seed).to(device)
    numel = grad.numel()
    k = count_from(numel, density, None)
    topk_ms, (top_values, _) = time_ms(lambda: torch.topk(grad.abs(), k, sorted=False), repeat, device)
    pass_ms, _ = time_ms(lambda: grad.sum(), repeat, device)
    threshold = float(top_values.min())  # the absolute threshold that selects exactly k here
    rows = []
    topk_at = {k: topk_ms}  # torch.topk's time at each count a sparsifier targets
    for text in tqdm(sparsifiers or default_sparsifiers(density, threshold), desc="sparsifiers", disable=None):
        sparsifier = SPARSIFIERS.parse(text)
        generator = torch.Generator(device=grad.device).manual_seed(seed)
        ms, selection = time_ms(partial(sparsifier.sparsify, grad, generator), repeat, device)
        target = sparsifier.target_count(numel)
        count = min(numel, target) if target else k
        if count not in topk_at:  # a sparsifier with a count of its own is raced against torch.topk at that count
            topk_at[count] = time_ms(partial(torch.topk, grad.abs(), count, sorted=False), repeat, device)[0]
        rows.append({
            "sparsifier": sparsifier.to_spec(),
            "ms": ms,
            "topk_ms": topk_at[count],
            "speedup_vs_topk": topk_at[count] / ms if ms > 0 else float("inf"),
            "selected": selection.nnz,
            "target": target if target is not None else k,
            "selected_over_target": selection.nnz / (target or k) if (target or k) else 0.0,
        })
    return {
        "benchmark": "sparsify", "device": str(grad.device), "numel": numel, "density": density, "source": source,
        "k": k,
        "repeat": repeat, "topk_ms": topk_ms, "pass_ms": pass_ms, "threads": torch.get_num_threads(),
        "rows": rows,
    }
