"""`TransportSession`: the runtime state transports keep between calls — the one worker thread
that runs asynchronous calls in submission order, the cost model, what ``auto`` has measured per
size class, the payload allgather's receive capacity, the receive buffers reused from call to
call, and each group's one-way twin (`TransportSession.one_way_group`). Its owner (a
`GradientReducer`, a benchmark) checkpoints it and closes it; no transport keeps state anywhere
else.

    with TransportSession() as session:
        future = transport.reduce_async(selection, group, request, session=session)
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.transport.collectives import Group
from sparsecomm.transport.cost_model import CostModel, load_cost_model
from sparsecomm.transport.tuning import Tuning
from sparsecomm.transport.waiting import WORKER_THREAD_PREFIX


class TransportSession:
    """State shared by the transport calls of one owner on one process group."""

    def __init__(self, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model or load_cost_model()
        self.tunings: dict[tuple, Tuning] = {}
        """auto's measurements per size class (N, nnz class, value size, P, auto's settings)"""
        self.expected: dict[tuple, str] = {}
        """per stream (N, value size, P, auto's spec): what its next call runs if its size class stays"""
        self.split_points: dict[tuple, tuple[int, ...]] = {}
        """per stream (key, N, P): split-allgather's range bounds, balanced by the last result's nonzeros"""
        self.payload_capacity = 0
        """bytes each rank receives per peer in the first round of a payload allgather: the same on every
        rank, as it follows only sizes every rank saw (see `sparsecomm.transport.payload_exchange`).
        Not checkpointed: a rank that starts afresh next to one that resumes starts at 0, and the
        ranks' capacities must match (it costs one step's second round, never a result)."""
        self._executor: ThreadPoolExecutor | None = None
        self._buffers: dict[tuple[str, int, torch.device], torch.Tensor] = {}
        """receive buffers by (purpose, peer, device): a cache, not state (not checkpointed)"""
        self._one_way: dict[Group, dist.ProcessGroup] = {}
        """by group: its one-way twin (`one_way_group`), a resource like the buffers (not destroyed)"""

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the session's worker thread, after every task submitted before it, with
        the submitting thread's current CUDA device (a new thread's is device 0, whatever rank),
        its stream waiting for what the submitting thread's stream had queued by then (the
        gradient a task reads, where the backward pass runs on a stream of its own)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WORKER_THREAD_PREFIX)
        if torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            queued = torch.cuda.current_stream(device).record_event()

            def on_device() -> None:
                with torch.cuda.device(device):
                    torch.cuda.current_stream(device).wait_event(queued)
                    task()

            self._executor.submit(on_device)
        else:
            self._executor.submit(task)

    def receive_buffer(self, purpose: str, peer: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of uint8 on ``device`` for what ``peer`` sends for ``purpose``, the same memory
        call after call (grown when too small): a fresh 32 MB buffer costs 5 ms here against 2.3 ms
        to fill a reused one, its pages faulted in anew. Valid until the next call asks for the same
        purpose and peer, so a transport reads it (and copies what it keeps) before it returns."""
        key = (purpose, peer, torch.device(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._buffers[key] = buffer
        return buffer[:nbytes]

    def receiver(self, purpose: str) -> Callable[[int, int, torch.device], torch.Tensor]:
        """`receive_buffer` for one purpose, as the collectives take it."""
        return lambda peer, nbytes, device: self.receive_buffer(purpose, peer, nbytes, device)

    def one_way_group(self, group: Group) -> dist.ProcessGroup:
        """A second gloo group over ``group``'s ranks, made on the first call that asks (every rank
        of ``group`` asks in the same call), on which `Arrivals` sends each message to a lower rank:
        no gloo pair then carries both directions. gloo runs a pair's two directions under one lock,
        so a send waits while the peer's message streams in. It outlives the session: a group made
        again over the same ranks after one was destroyed gets the destroyed one's name, and can
        meet its rendezvous keys in the store."""
        if group not in self._one_way:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            self._one_way[group] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        return self._one_way[group]

    def drain(self) -> None:
        """Wait until every task submitted so far has run (the caller may then use the group itself)."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for submitted calls, then stop the worker thread (a later call starts a new one)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._buffers.clear()
        self._one_way.clear()

    def __enter__(self) -> TransportSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return {"tunings": [(key, tuning.state_dict()) for key, tuning in self.tunings.items()],
                "expected": list(self.expected.items()),
                "split_points": [(key, list(bounds)) for key, bounds in self.split_points.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tunings = {tuple(key): Tuning.from_state_dict(saved) for key, saved in state["tunings"]}
        self.expected = {tuple(key): name for key, name in state["expected"]}
        self.split_points = {tuple(key): tuple(bounds) for key, bounds in state["split_points"]}
        self.payload_capacity = 0  # as on every rank that did not load this: see its docstring
