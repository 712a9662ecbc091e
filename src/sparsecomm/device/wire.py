"""One fixed-size int32 buffer per bucket and rank: a header word (the bucket layout's digest),
then the capacity's indices, then their fp32 values' bits. Every rank's is the same size, so one
equal-size all_gather carries them; the receiver sums them on the device, rank by rank (each
rank's indices are distinct, so every sum is made in the same order everywhere)."""

from __future__ import annotations

import torch

HEADER = 1
"""words before the indices: the layout's digest"""


def words(capacity: int) -> int:
    """The buffer's length for ``capacity`` entries."""
    return HEADER + 2 * capacity


def pack(out: torch.Tensor, digest: int, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Write the header, ``indices`` and fp32 ``values`` into ``out`` (int32, `words` long)."""
    capacity = indices.numel()
    out[0] = digest
    out[HEADER:HEADER + capacity].copy_(indices)
    out[HEADER + capacity:].view(torch.float32).copy_(values)
    return out


def unpack_sum(gathered: torch.Tensor, world_size: int, numel: int, digest: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' buffers (``gathered``, world_size of them end to end) summed into a dense fp32
    tensor of ``numel`` on ``device``, and a 0-d bool: whether every rank's header matched
    ``digest`` (its indices are clamped into range, so a stranger's buffer sums to garbage, never
    out of bounds; the caller raises on the flag)."""
    rows = gathered.to(device).view(world_size, -1)
    capacity = (rows.shape[1] - HEADER) // 2
    agreed = (rows[:, 0] == digest).all()
    indices = rows[:, HEADER:HEADER + capacity].long().clamp_(0, max(numel - 1, 0))
    values = rows[:, HEADER + capacity:].contiguous().view(torch.float32)
    total = torch.zeros(numel, dtype=torch.float32, device=device)
    for rank in range(world_size):
        total.index_add_(0, indices[rank], values[rank])
    return total, agreed
