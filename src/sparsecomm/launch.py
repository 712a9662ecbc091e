"""Start P local worker processes on one torch.distributed group and collect what each returns.

    results = run_local(4, my_function, arg1, arg2)   # my_function(rank, world_size, arg1, arg2)

Workers are forked from a server process that has imported torch and sparsecomm once
(multiprocessing's forkserver; spawned where there is none), so one starts in a fraction of a
second rather than the seconds an import of torch takes; each takes the caller's environment,
working directory and ``sys.path`` as they are at the call. They keep freed host memory
(`keep_freed_host_memory`), join a gloo group through a file store in a private temporary
directory, and send back their return value (pickled by value, so tensors survive the worker's
exit) or their traceback. A worker that raises or dies makes `run_local` raise `WorkerError`
naming the rank (one killed by a signal first prints every thread's Python stack on standard
error); the others get ``FAILURE_GRACE_S`` to report, then are killed (they would otherwise wait in
a collective for the failed rank). Workers still running after ``timeout`` are killed too.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import queue as queue_module
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsecomm.host_memory import keep_freed_host_memory

FAILURE_GRACE_S = 5.0
"""after a worker fails, how long the others get to report before they are stopped"""


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its rank and traceback."""


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
              threads_per_worker: int | None = None, backend: str = "gloo",
              namespaces: list[str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return results by rank.
    With ``namespaces`` (see `sparsecomm.netns.ShapedNetwork`), rank r runs in namespaces[r]."""
    context = _context()
    results: Any = context.Queue()
    caller = (dict(os.environ), os.getcwd(), list(sys.path))
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="sparsecomm-") as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        processes = [
            context.Process(target=_worker, daemon=True,
                            args=(rank, world_size, init, backend, threads, timeout, fn, args, results,
                                  namespaces[rank] if namespaces else None, caller))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        collected: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(collected) + len(failures) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if failures:  # the others are stuck waiting for the failed rank: stop them
                        break
                    raise WorkerError(f"workers timed out after {timeout:.0f} s; finished: {sorted(collected)}")
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue_module.Empty:
                    for dead, process in enumerate(processes):
                        if process.exitcode not in (None, 0) and dead not in collected and dead not in failures:
                            failures[dead] = f"rank {dead}: exited with code {process.exitcode} before reporting"
                    if failures:
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                    continue
                if ok:
                    collected[rank] = pickle.loads(value)
                else:
                    failures[rank] = f"rank {rank}:\n{value}"
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        finally:
            for process in processes:
                process.join(timeout=5 if not failures else 1)
                if process.is_alive():
                    process.kill()
        if failures:
            raise WorkerError("\n".join(failures[rank] for rank in sorted(failures)))
        return [collected[rank] for rank in range(world_size)]


PRELOADED = ("sparsecomm", "sparsecomm.launch")
"""what the server that forks workers imports once (torch with them)"""


def _context() -> Any:
    """Forking from a server that has imported torch and sparsecomm, where the platform has one."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))  # read when the server starts, on the first call
    return context


def _worker(rank: int, world_size: int, init: str, backend: str, threads: int, timeout: float,
            fn: Callable[..., Any], args: tuple, results: Any, namespace: str | None,
            caller: tuple[dict[str, str], str, list[str]]) -> None:
    environment, directory, path = caller  # the server's own are as they were when it started
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(directory)
    sys.path[:] = path
    faulthandler.enable(all_threads=True)  # a worker killed by a signal prints every thread's Python stack
    torch.set_num_threads(threads)
    keep_freed_host_memory()
    finished = False
    try:
        if namespace:
            from sparsecomm.netns import enter_namespace

            enter_namespace(namespace)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensor storage into the bytes; the queue's own pickler would share it
        # through a file descriptor that dies with this process before the parent reads it.
        results.put((rank, True, pickle.dumps(value)))
        finished = True
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if finished:
                # no rank closes its connections while a peer still uses them (gloo fails a peer
                # still setting up a group with "connectFullMesh failed"); a peer that failed never
                # comes, and the parent stops this process
                with contextlib.suppress(Exception):
                    dist.barrier()
            dist.destroy_process_group()
