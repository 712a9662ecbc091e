"""`Topology`: which ranks share a node. Inside a node ranks reach each other over a fast fabric
(NVLink, shared memory); between nodes over a slower network — the link compression pays on.

Ranks are laid out as torchrun lays them out on nodes of equal size: node ``n`` holds the group's
ranks ``n·L … n·L + L − 1`` (``L`` ranks per node), so rank ``r`` is local rank ``r mod L`` of node
``r // L``. `NodeGroups` are the process groups a hierarchical step needs: this rank's node, and the
ranks of every node with this rank's local rank (its peers across nodes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sparsecomm.errors import SparseCommError
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.request import Request

ACROSS, NODE = "across", "node"
"""the dimension names of a topology's device mesh: the nodes, and one node's ranks"""


@dataclass(frozen=True)
class Topology:
    """``local_size`` ranks on each node (1: every rank its own node — a flat group).

    Example:
        ```python
        import sparsecomm as sc

        topology = sc.Topology(8)   # under torchrun: sc.Topology.from_env()
        assert topology.describe(16) == "2 nodes × 8 ranks"
        ```
    """

    local_size: int

    def __post_init__(self) -> None:
        if self.local_size < 1:
            raise SparseCommError(f"a node holds at least one rank, not {self.local_size}")

    @classmethod
    def from_env(cls) -> Topology:
        """The topology torchrun describes: ``LOCAL_WORLD_SIZE`` ranks per node.

        Raises:
            SparseCommError: ``LOCAL_WORLD_SIZE`` is not set (not launched by torchrun), or this
                rank's ``RANK`` is not where torchrun's ``GROUP_RANK`` and ``LOCAL_RANK`` place it.
        """
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise SparseCommError("LOCAL_WORLD_SIZE is not set: launch with torchrun, or pass Topology(local_size=…)")
        topology = cls(int(os.environ["LOCAL_WORLD_SIZE"]))
        if all(name in os.environ for name in ("RANK", "GROUP_RANK", "LOCAL_RANK")):
            rank, node, local = (int(os.environ[name]) for name in ("RANK", "GROUP_RANK", "LOCAL_RANK"))
            if rank != node * topology.local_size + local:
                raise SparseCommError(f"rank {rank} is local rank {local} of node {node}, not rank "
                                      f"{node * topology.local_size + local} as nodes of {topology.local_size} ranks "
                                      "each lay them out: pass the node layout explicitly")
        return topology

    def nodes(self, world_size: int) -> int:
        """How many nodes ``world_size`` ranks fill.

        Raises:
            SparseCommError: ``world_size`` is not a multiple of ``local_size``.
        """
        if world_size % self.local_size:
            raise SparseCommError(f"{world_size} ranks do not fill nodes of {self.local_size} ranks each")
        return world_size // self.local_size

    def describe(self, world_size: int) -> str:
        return f"{self.nodes(world_size)} nodes × {self.local_size} ranks"

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """The world as a nodes × ranks-per-node device mesh, dimensions named `ACROSS` and `NODE`:
        ``fully_shard(module, mesh=mesh["node"])`` shards inside each node (see `register_fsdp_hooks`).

        Raises:
            SparseCommError: the world does not fill the nodes, or the ranks' topologies differ — on
                every rank (meshes of other shapes would wait for each other forever)."""
        agree(None, Request(key="Topology.device_mesh"), self.local_size, 0)
        return init_device_mesh(device_type, (self.nodes(dist.get_world_size()), self.local_size),
                                mesh_dim_names=(ACROSS, NODE))


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in a topology and the process groups a hierarchical step uses."""

    topology: Topology
    nodes: int
    node: int
    """this rank's node"""
    local_rank: int
    node_group: dist.ProcessGroup
    """this rank's node"""
    cross_group: dist.ProcessGroup
    """the ranks of every node with this rank's local rank"""

    @classmethod
    def make(cls, topology: Topology, group: dist.ProcessGroup | None) -> NodeGroups:
        """The groups of ``topology`` over ``group``'s ranks (every rank of it calls this together)."""
        ranks = _ranks(group)
        local_size, nodes = topology.local_size, topology.nodes(len(ranks))
        node, local_rank = divmod(dist.get_rank(group), local_size)
        cross_ranks = [ranks[local::local_size] for local in range(local_size)]
        node_group = node_twin(topology, group)
        cross_group = _own_group(cross_ranks)
        return cls(topology, nodes, node, local_rank, node_group, cross_group)


def node_twin(topology: Topology, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new group over this rank's node (of ``topology`` over ``group``'s ranks; every rank of
    ``group`` calls it together): a node's collectives of one purpose, ordered apart from others."""
    ranks, local_size = _ranks(group), topology.local_size
    return _own_group([ranks[n * local_size:(n + 1) * local_size] for n in range(topology.nodes(len(ranks)))])


def _own_group(groups: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group of ``groups`` (lists of ranks that partition the caller's group): made by
    every rank of the world together where they cover it, else by its own ranks alone (over a part
    of the world the other ranks never take part)."""
    if sum(map(len, groups)) == dist.get_world_size():
        return dist.new_subgroups_by_enumeration(groups)[0]
    mine = next(ranks for ranks in groups if dist.get_rank() in ranks)
    return dist.new_group(ranks=mine, use_local_synchronization=True)


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
