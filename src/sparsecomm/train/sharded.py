"""FSDP2 rows of `sparsecomm train` (``fully_shard``): PyTorch's own sharded data parallelism and
sparsecomm's compression under it.

- ``torch-fsdp``: one FSDP group over every rank (each rank holds 1/P of the model; parameters are
  all-gathered for the forward and backward passes, gradients reduce-scattered).
- ``torch-hsdp``: FSDP's native hybrid sharding: sharded inside each node, each shard's gradient
  all-reduced densely across nodes.
- ``fsdp:PRESET``: sharded inside each node as HSDP, each shard averaged across nodes through
  PRESET (`register_fsdp_hooks`).
- ``fsdp-flat:SPEC``: one FSDP group over every rank, each module's reduce-scatter sending each
  owner only the largest entries of its range (SPEC: ``topk(ratio=R)+residual`` with fp values).

A transformer's blocks (or else each child holding parameters) are FSDP modules, and the root another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sparsecomm.reducer.fsdp_hook import FSDPCompression, register_fsdp_hooks
from sparsecomm.reducer.topology import NODE, Topology
from sparsecomm.train.baselines import BytesMeter
from sparsecomm.train.row_names import FLAT_FSDP, preset_of

if TYPE_CHECKING:
    from sparsecomm.reducer.sparse_reduce_scatter import FlatFSDPCompression

def shard(module: nn.Module, mesh: Any) -> nn.Module:
    """``module`` under FSDP2 on ``mesh``, then its root: a transformer's blocks (the entries of its
    ``ModuleList``s; the embeddings stay with the root, where a tied output head uses them), or
    else each child holding parameters."""
    blocks = [block for child in module.modules() if isinstance(child, nn.ModuleList) for block in child]
    for part in blocks or [child for child in module.children() if any(True for _ in child.parameters())]:
        fully_shard(part, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def build(row: str, module: nn.Module, nodes: int, seed: int
          ) -> tuple[nn.Module, FSDPCompression | FlatFSDPCompression | None, BytesMeter | None]:
    """The row's sharded model, and what counts its bytes: the compression's stats (``fsdp:``,
    ``fsdp-flat:``) or a meter of the gradient bytes each rank hands its reduction (PyTorch's rows;
    the parameters' all-gathers are on the link's counters only)."""
    world = dist.get_world_size()
    device_type = next(module.parameters()).device.type
    numel = sum(p.numel() for p in module.parameters())
    if row == "torch-fsdp":
        model = shard(module, init_device_mesh(device_type, (world,)))
        return model, None, BytesMeter(lambda steps: 4 * numel * steps)
    if row.startswith(FLAT_FSDP):
        flat = init_device_mesh(device_type, (world,))
        model = shard(module, flat)
        return model, register_fsdp_hooks(model, preset_of(row), flat, seed=seed), None
    mesh = Topology(world // nodes).device_mesh(device_type)
    if row == "torch-hsdp":
        model = shard(module, mesh)  # a 2-D mesh: replicated across its first dimension, sharded in its second
        return model, None, BytesMeter(lambda steps: 4 * numel * steps // (world // nodes))
    model = shard(module, mesh[NODE])
    return model, register_fsdp_hooks(model, preset_of(row), mesh, seed=seed), None


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (a sharded one gathered), for a digest the ranks compare."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
