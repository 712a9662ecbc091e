"""What a training step asks of the host, counted: aten ops (each one a kernel launch on a GPU),
host syncs (ops that make the host wait for the device on a GPU: a scalar read — ``.item()``,
``bool(tensor)`` — and ``nonzero``) and, on a GPU, the bytes copied between host and device (by
tensor ops, and by gloo where it carries CUDA tensors through the host). Read from torch's
profiler, which records the ops of every thread of the process — the caller's, the reducer's
worker thread and the backward pass's — and, with CUDA's activity, the device's copies."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero"})
"""where every scalar read (``item``, ``is_nonzero``, ``bool``) and every data-dependent size ends"""
HOST_DEVICE_COPIES = ("Memcpy HtoD", "Memcpy DtoH")
"""how the profiler names a device's copies from and to the host (``Memcpy DtoD`` stays on it)"""
COPIED_BYTES = re.compile(r'"bytes": (\d+)')
"""a copy's bytes in the profiler's metadata text"""


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
    with profile(activities=activities) as recorded:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize(device)  # every copy the steps queued has run, and is recorded
    ops = syncs = copied = 0
    for event in recorded.events():
        copied += host_device_bytes(event)
        if not event.name.startswith("aten::"):
            continue
        syncs += event.name in SYNC_OPS
        parent = event.cpu_parent
        ops += parent is None or not parent.name.startswith("aten::")  # a launch, not an op's own inner op
    return OpCounts(ops / steps, syncs / steps, copied / steps)


def host_device_bytes(event: Any) -> int:
    """The bytes a profiler event copied between host and device: a CUDA copy's, as its metadata
    says (0 for every other event)."""
    if event.device_type != DeviceType.CUDA or not event.name.startswith(HOST_DEVICE_COPIES):
        return 0
    metadata = getattr(event, "event_metadata", None)
    copied = getattr(metadata, "bytes", None)
    if copied is not None:
        return int(copied)
    # a torch before the structured metadata, or one that left it empty for this event
    found = COPIED_BYTES.search(getattr(event, "metadata_json", None) or "")
    return int(found.group(1)) if found else 0

