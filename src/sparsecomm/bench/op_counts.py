"""What a training step asks of the host, counted: aten ops (each one a kernel launch on a GPU) and
host syncs (ops that make the host wait for the device on a GPU: a scalar read — ``.item()``,
``bool(tensor)`` — and ``nonzero``). Read from torch's profiler, which records the ops of every
thread of the process: the caller's, the reducer's worker thread and the backward pass's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero"})
"""where every scalar read (``item``, ``is_nonzero``, ``bool``) and every data-dependent size ends"""


@dataclass(frozen=True)
class OpCounts:
    """Per step: aten ops called from outside another aten op, and host syncs."""

    ops: float
    syncs: float


def count_ops(step: Callable[[], None], steps: int) -> OpCounts:
    """``step`` run ``steps`` times under the profiler: its ops and syncs per step."""
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        for _ in range(steps):
            step()
    ops = syncs = 0
    for event in recorded.events():
        if not event.name.startswith("aten::"):
            continue
        syncs += event.name in SYNC_OPS
        parent = event.cpu_parent
        ops += parent is None or not parent.name.startswith("aten::")  # a launch, not an op's own inner op
    return OpCounts(ops / steps, syncs / steps)

