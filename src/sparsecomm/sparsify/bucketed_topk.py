"""``bucketed_topk``: SparCML's bucketed top-k (§8.3) — the k largest-magnitude entries of every
``bucket`` consecutive entries (k from ``k`` per bucket, or ``ratio`` of the bucket). One batched
top-k over a (buckets × bucket) view; cheaper than a global top-k and spreads the selection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, CountedSparsifier, gather


@SPARSIFIERS.register("bucketed_topk")
@dataclass(frozen=True)
class BucketedTopK(CountedSparsifier):
    bucket: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket < 1:
            raise SparseCommError("bucketed_topk bucket must be >= 1")

    def per_bucket(self) -> int:
        return self.count(self.bucket)

    def target_count(self, numel: int) -> int:
        full, tail = divmod(numel, self.bucket)
        return full * self.per_bucket() + min(tail, self.per_bucket())

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        flat = tensor.reshape(-1)
        numel = flat.numel()
        n_buckets = -(-numel // self.bucket)
        magnitudes = F.pad(flat.abs(), (0, n_buckets * self.bucket - numel), value=-1.0)
        _, local = torch.topk(magnitudes.reshape(n_buckets, self.bucket), self.per_bucket(), dim=1, sorted=False)
        base = torch.arange(n_buckets, device=flat.device)[:, None] * self.bucket
        indices = (local + base).reshape(-1)
        return gather(tensor, indices[indices < numel])
