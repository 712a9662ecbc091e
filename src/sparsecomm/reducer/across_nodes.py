"""`AcrossNodes`: what a reducer over nodes passes through to its hop between nodes — a
`GradientReducer` over the ranks that hold the same shard on every node."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparsecomm.adaptive.controller import AdaptiveController
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.reducer.stats import ReducerStats
from sparsecomm.spec import PipelineSpec
from sparsecomm.transport.collectives import on_wire, wire_device


class AcrossNodes:
    """The hop between nodes (``across``): its pipeline, counts and ``adaptive`` controller."""

    across: GradientReducer
    """averages each shard over the nodes"""

    @property
    def spec(self) -> PipelineSpec:
        return self.across.spec

    @property
    def stats(self) -> ReducerStats:
        """What this rank sent between nodes, per stream and in all."""
        return self.across.stats

    @property
    def adaptive(self) -> AdaptiveController | None:
        """The ``adaptive`` sparsifier's controller of the hop between nodes (None for other pipelines)."""
        return self.across.adaptive

    def suit_optimizer(self, optimizer: torch.optim.Optimizer) -> str | None:
        """`GradientReducer.suit_optimizer`, for the hop between nodes."""
        return self.across.suit_optimizer(optimizer)


def failed_in_node(failed: bool, node_group: dist.ProcessGroup) -> bool:
    """Whether any rank of this node failed its hop between nodes. The ranks holding one shard fail
    together, but not with the node's other shards: one small all-reduce in the node then lets every
    rank raise, none left waiting in the node's next collective."""
    flag = on_wire(torch.tensor([int(failed)], dtype=torch.int32), wire_device(node_group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=node_group)
    return bool(flag.item())
