"""`NodeShards`: how a node splits one flat buffer of named tensors among its ranks.

Each tensor is cut into ``L`` near-equal slices (``L`` ranks per node); local rank ``l`` owns slice
``l`` of every tensor. So a rank always owns the same elements of a parameter, whatever bucket DDP
puts it in: the state its slices keep across nodes (residuals, momentum) stays keyed by the
parameter's name, and a bucket rebuild moves none of it. The buffer is reordered into ``L`` equal
shards — one ``index_select`` with an index worked out once per layout — so that one dense
reduce-scatter sums each shard onto its owner, and one all-gather plus one ``index_copy_`` puts
the reduced shards back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.pipeline import Segment


@dataclass(frozen=True)
class NodeShards:
    """The shards of a buffer of ``numel`` elements laid out as ``segments``, over ``local_size`` ranks."""

    numel: int
    shard_numel: int
    """each shard's size on the wire: the largest rank's share (the others padded to it)"""
    owned: tuple[tuple[Segment, ...], ...]
    """per local rank: its slices, as segments of its shard"""
    index: torch.Tensor
    """for each element of the ``local_size`` shards laid end to end, where it is in the buffer
    (``numel``: padding)"""
    gathered: torch.Tensor
    """``index`` with the padding pointing at the buffer's first element (zeroed after the gather)"""
    padding: torch.Tensor
    """where the padding sits in the shards laid end to end"""

    @classmethod
    def of(cls, segments: tuple[Segment, ...], numel: int, local_size: int, device: torch.device) -> NodeShards:
        """Split ``segments`` (each a named tensor in a buffer of ``numel`` elements) among ``local_size`` ranks."""
        positions: list[list[torch.Tensor]] = [[] for _ in range(local_size)]
        owned: list[list[Segment]] = [[] for _ in range(local_size)]
        filled = [0] * local_size
        for segment in segments:
            width = -(-segment.numel // local_size)
            for local in range(local_size):
                start = segment.start + local * width
                stop = min(segment.start + segment.numel, start + width)
                if stop <= start:
                    continue
                owned[local].append(Segment(segment.key, filled[local], stop - start, segment.whole))
                positions[local].append(torch.arange(start, stop))
                filled[local] += stop - start
        shard_numel = max(filled)
        index = torch.full((local_size, shard_numel), numel, dtype=torch.int64)
        for local, parts in enumerate(positions):
            if parts:
                index[local, :filled[local]] = torch.cat(parts)
        index = index.view(-1)
        padding = index == numel
        return cls(numel, shard_numel, tuple(map(tuple, owned)), index.to(device),
                   index.masked_fill(padding, 0).to(device), padding.nonzero().view(-1).to(device))

    def owned_numel(self, local_rank: int) -> int:
        return sum(segment.numel for segment in self.owned[local_rank])

    def to_shards(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` as ``local_size`` shards end to end (padding zero): a reduce-scatter's input."""
        return buffer.reshape(-1).index_select(0, self.gathered).index_fill_(0, self.padding, 0)

    def from_shards(self, shards: torch.Tensor) -> torch.Tensor:
        """The buffer the ``local_size`` shards (an all-gather's output) hold."""
        padded = shards.new_empty(self.numel + 1)
        padded.index_copy_(0, self.index, shards)
        return padded[:self.numel]
