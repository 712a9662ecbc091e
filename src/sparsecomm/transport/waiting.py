"""`wait_polling`: wait for a collective on the processor by polling it, handing the processor to
any other runnable thread each time round, for up to `POLL_S`; then sleep on it as ``wait`` does.

A thread that sleeps on a collective is woken by the thread that completes it, and on a host whose
cores the ranks keep busy the wake-up can take longer than a fast link's collective itself: a small
model's gloo all_reduce after the backward, slept on, takes several times as long at the median as
polled. A waiter that polls with ``sched_yield`` keeps its processor awake but gives it to the
collective's own threads whenever they can run. Beyond `POLL_S` it sleeps: a long wait (a slow
link, a rank held up) holds a core no longer than that.

Only for what C++ threads complete: gloo's collectives (its worker threads run them) and their
futures. Not for gloo's point-to-point works, which complete only inside ``wait`` (polled, they
never report done, so every poll would run the whole `POLL_S`), nor for futures that Python
callbacks complete (the poller would hold the interpreter lock they need). A CUDA collective's
``wait`` makes the stream wait, not the processor: NCCL's future is done once its work is queued,
so it goes straight to its ``wait``.
Nor on the transport's worker thread (`WORKER_THREAD_PREFIX`), whose waits overlap the backward
pass: there a poller would take processor and interpreter from the computation.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

POLL_S = 0.02
"""how long a waiter polls before it sleeps"""
WORKER_THREAD_PREFIX = "sparsecomm-transport"
"""the name of the thread that runs a step's earlier calls while the backward computes"""

_yield_processor = getattr(os, "sched_yield", lambda: time.sleep(0))


def wait_polling(pending: dist.Work | torch.futures.Future, limit_s: float = POLL_S) -> Any:
    """``pending.wait()``, polled first for up to ``limit_s`` seconds (see the module docstring):
    its result (a future's value, a work's flag), or its error."""
    done: Callable[[], bool] = getattr(pending, "is_completed", None) or getattr(pending, "done")  # noqa: B009
    if not done():
        deadline = time.perf_counter() + limit_s
        while not done() and time.perf_counter() < deadline:
            _yield_processor()
    return pending.wait()


def wait_for(work: dist.Work, device: torch.device) -> None:
    """A collective on ``device``'s tensors: polled where the processor completes it (the CPU's,
    `wait_polling`) and nothing else waits for the processor (not on the worker thread), else
    waited for as torch does (a device's stream waits)."""
    if device.type == "cpu" and not threading.current_thread().name.startswith(WORKER_THREAD_PREFIX):
        wait_polling(work)
    else:
        work.wait()
