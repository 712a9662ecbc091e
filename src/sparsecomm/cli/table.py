"""Plain-text tables and JSON files for benchmark results."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

import torch


def format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 0.01:
            return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
        return f"{value:.2e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[format_cell(row.get(col, "")) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    numeric = [all(isinstance(row.get(col), int | float | None) for row in rows) for col in columns]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    record = dict(result)
    record["machine"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
