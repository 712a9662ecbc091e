"""``block_topk``: S2 Reducer's block-wise top-K — cut the flat tensor into blocks of ``block``
entries, keep the blocks of largest L2 norm (``ratio`` of the blocks, or ``k`` blocks), send every
entry of the kept blocks. An embedding row is the natural block of an embedding gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, CountedSparsifier, gather


@SPARSIFIERS.register("block_topk")
@dataclass(frozen=True)
class BlockTopK(CountedSparsifier):
    block: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block < 1:
            raise SparseCommError("block_topk block must be >= 1")

    def n_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def target_count(self, numel: int) -> int:
        return min(numel, self.count(self.n_blocks(numel)) * self.block)

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        flat = tensor.reshape(-1)
        numel = flat.numel()
        blocks = F.pad(flat, (0, self.n_blocks(numel) * self.block - numel)).reshape(-1, self.block)
        kept = self.count(blocks.shape[0])
        _, chosen = torch.topk(torch.linalg.vector_norm(blocks.float(), dim=1), kept, sorted=False)
        chosen = torch.sort(chosen).values
        indices = (chosen[:, None] * self.block + torch.arange(self.block, device=flat.device)).reshape(-1)
        return gather(tensor, indices[indices < numel])
