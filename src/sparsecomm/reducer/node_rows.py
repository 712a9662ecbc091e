"""A sparse gradient (an embedding's rows) inside a node, for `HierarchicalReducer`: summed by an
all-gather of every rank's rows, split among the node's ranks by row — local rank ``l`` owns the
rows whose number is ``l`` modulo the ranks per node, so an embedding's frequent rows spread over
every rank — and put back together by another all-gather. Rows travel as bytes, their indices then
their values, through gloo's variable-length all-gather (`allgather_bytes`); what arrives is
checked before it is read."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.transport.collectives import allgather_bytes


def summed(grad: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, int]:
    """The sum of every node rank's sparse ``grad`` (coalesced), and the bytes this rank sent."""
    return _gathered(grad.coalesce(), group)


def owned(total: torch.Tensor, local_size: int, local_rank: int) -> torch.Tensor:
    """The rows of the coalesced ``total`` that ``local_rank`` owns (the first index modulo ``local_size``)."""
    mine = total.indices()[0] % local_size == local_rank
    return torch.sparse_coo_tensor(total.indices()[:, mine], total.values()[mine], total.shape,
                                   is_coalesced=True, check_invariants=False)  # a coalesced tensor's rows


def put_together(averaged: torch.Tensor, like: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, int]:
    """Every node rank's ``averaged`` rows (a shard's, sparse or dense) as one coalesced sparse
    tensor of ``like``'s shape and layout, and the bytes this rank sent."""
    if not averaged.is_sparse:
        averaged = averaged.to_sparse(like.sparse_dim())
    return _gathered(averaged.coalesce(), group)


def _gathered(rows: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, int]:
    data = _as_bytes(rows)
    parts = [_from_bytes(part.to(rows.device), rows) for part in allgather_bytes(data, group)]
    indices = torch.cat([index for index, _ in parts], dim=1)
    values = torch.cat([value for _, value in parts])
    total = torch.sparse_coo_tensor(indices, values, rows.shape, check_invariants=False).coalesce()  # checked rows
    return total, data.numel() * (dist.get_world_size(group) - 1)


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    indices = rows.indices().t().contiguous().reshape(-1).view(torch.uint8)
    return torch.cat([indices, rows.values().contiguous().reshape(-1).view(torch.uint8)])


def _from_bytes(data: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of rows that arrived as ``data``, shaped as ``like``'s.

    Raises:
        SparseCommError: the bytes are not whole rows, or an index lies outside ``like``'s shape."""
    sparse_dim, row_shape = like.sparse_dim(), like.shape[like.sparse_dim():]
    index_bytes = 8 * sparse_dim
    row_bytes = index_bytes + math.prod(row_shape) * like.values().element_size()
    if data.numel() % row_bytes:
        raise SparseCommError(f"rows from a rank of this node take {data.numel()} bytes, not a whole number of "
                              f"{row_bytes}-byte rows: the gradients differ in shape or the bytes are corrupt")
    count = data.numel() // row_bytes
    data = data.contiguous()
    indices = data[:count * index_bytes].view(torch.int64).view(count, sparse_dim).t()
    bounds = torch.tensor(like.shape[:sparse_dim], dtype=torch.int64, device=data.device)[:, None]
    if count and not bool(((indices >= 0) & (indices < bounds)).all()):
        raise SparseCommError(f"rows from a rank of this node name indices outside {tuple(like.shape)}")
    values = data[count * index_bytes:].view(like.values().dtype).view(count, *row_shape)
    return indices, values
