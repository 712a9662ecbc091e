"""``block_topk``: S2 Reducer's block-wise top-K — cut the flat tensor into blocks of ``block``
entries, keep the blocks of largest L2 norm (``ratio`` of the blocks, or ``k`` blocks), send every
entry of the kept blocks. An embedding row is the natural block of an embedding gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, Sparsifier, check_ratio_or_count, count_from, gather


@SPARSIFIERS.register("block_topk")
@dataclass(frozen=True)
class BlockTopK(Sparsifier):
    ratio: float | None = None
    k: int | None = None
    block: int = 256

    def __post_init__(self) -> None:
        check_ratio_or_count("block_topk", self.ratio, self.k)
        if self.block < 1:
            raise SparseCommError("block_topk block must be >= 1")

    def n_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def target_count(self, numel: int) -> int:
        return min(numel, count_from(self.n_blocks(numel), self.ratio, self.k) * self.block)

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        flat = tensor.reshape(-1)
        numel = flat.numel()
        blocks = F.pad(flat, (0, self.n_blocks(numel) * self.block - numel)).reshape(-1, self.block)
        kept = count_from(blocks.shape[0], self.ratio, self.k)
        _, chosen = torch.topk(torch.linalg.vector_norm(blocks.float(), dim=1), kept, sorted=False)
        chosen = torch.sort(chosen).values
        indices = (chosen[:, None] * self.block + torch.arange(self.block, device=flat.device)).reshape(-1)
        return gather(tensor, indices[indices < numel])
