"""What a training step asks of the host, counted: aten ops (each one a kernel launch on a GPU),
host syncs (ops that make the host wait for the device on a GPU: a scalar read — ``.item()``,
``bool(tensor)`` — and ``nonzero``) and, on a GPU, the bytes copied between host and device (by
tensor ops, and by gloo where it carries CUDA tensors through the host). Read from torch's
profiler, told to record the ops of every thread of the process — the caller's, the backward pass's,
the reducer's worker thread and the collective's, where a finished future runs its callbacks — and,
with CUDA's activity, the device's copies."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero"})
"""where every scalar read (``item``, ``is_nonzero``, ``bool``) and every data-dependent size ends"""
HOST_DEVICE_COPIES = ("Memcpy HtoD", "Memcpy DtoH")
"""how the profiler names a device's copies from and to the host (``Memcpy DtoD`` stays on it)"""


@dataclass(frozen=True)
class OpCounts:
    """Per step: aten ops called from outside another aten op, host syncs, and the bytes copied
    between host and device (0 where the step runs on the host)."""

    ops: float
    syncs: float
    host_device_bytes: float = 0.0


def count_ops(step: Callable[[], None], steps: int, device: torch.device | str = "cpu") -> OpCounts:
    """``step`` run ``steps`` times under the profiler: its ops, syncs and, where it runs on a CUDA
    ``device``, host↔device bytes per step."""
    on_gpu = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities, **every_thread()) as recorded:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize(device)  # every copy the steps queued has run, and is recorded
    ops = syncs = 0
    for event in recorded.events():
        if not event.name.startswith("aten::"):
            continue
        syncs += event.name in SYNC_OPS
        parent = event.cpu_parent
        ops += parent is None or not parent.name.startswith("aten::")  # a launch, not an op's own inner op
    return OpCounts(ops / steps, syncs / steps, copied_bytes(recorded) / steps if on_gpu else 0.0)


def every_thread() -> dict[str, Any]:
    """The profiler's option to record every thread: by default it records the calling thread and
    the threads it hands work to (autograd's), not one that runs a collective's completion callbacks.
    Empty where this torch lacks the option."""
    try:
        return {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        return {}


def copied_bytes(recorded: profile) -> int:
    """The bytes copied between host and device while ``recorded`` ran, read from the trace torch
    writes of it: its events leave a copy's bytes out (torch 2.11 on CUDA 13), the trace names them."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        recorded.export_chrome_trace(path)
        with open(path) as trace:
            return host_device_bytes(json.load(trace).get("traceEvents", []))


def host_device_bytes(events: list[dict[str, Any]]) -> int:
    """The bytes a trace's ``events`` copied between host and device: each device copy from or to
    the host (a copy within the device, or the host's call that queued a copy, counts nothing)."""
    return sum(int((event.get("args") or {}).get("bytes", 0)) for event in events
               if event.get("cat") == "gpu_memcpy" and str(event.get("name", "")).startswith(HOST_DEVICE_COPIES))
