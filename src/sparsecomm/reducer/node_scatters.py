"""`NodeScatters`: a step's reduce-scatters inside the node, started without waiting, each shard
posted to the hop between nodes once its reduce-scatter has landed, in call order. The backward
pass then computes while the node sums (gloo's threads or the collective's stream run it), and
every rank posts its hop's calls in the same order, whenever each of its own landed."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsecomm.transport.waiting import wait_for


@dataclass(frozen=True)
class _Scatter:
    work: dist.Work | None
    """the reduce-scatter (None: nothing to wait for)"""
    tensors: tuple[torch.Tensor, ...]
    """what it reads and writes, held until it lands"""
    post: Callable[[], None]
    """posts the shard to the hop between nodes"""


class NodeScatters:
    """The reduce-scatters in flight, oldest first."""

    def __init__(self) -> None:
        self._queue: deque[_Scatter] = deque()

    def add(self, work: dist.Work | None, tensors: tuple[torch.Tensor, ...], post: Callable[[], None]) -> None:
        """One more call: ``work`` sums its shard into ``tensors``' first; ``post`` sends it on."""
        self._queue.append(_Scatter(work, tensors, post))

    def post_landed(self, wait: bool) -> None:
        """Post the oldest calls whose reduce-scatters have landed, stopping at the first still in
        flight; ``wait``: wait for each, so that every call is posted."""
        while self._queue:
            head = self._queue[0]
            if head.work is not None:
                if not wait and not head.work.is_completed():
                    return
                wait_for(head.work, head.tensors[0].device)
            self._queue.popleft()
            head.post()

    def drop(self) -> None:
        """Forget calls not posted (a step given up)."""
        self._queue.clear()
