"""``dgc``: Deep Gradient Compression's sampled threshold (§5 and its public code).

1. Sample about ``sample`` of the magnitudes (strided, random start from the generator).
2. Threshold = the smallest of the top ceil(samples·ratio) sampled magnitudes.
3. Select |g| ≥ threshold in one pass. If far more than k are selected (> ``upper``·k), keep the
   exact top-k of the selected; if too few (< ``lower``·k), lower the threshold by ``decay`` and
   select again, at most ``retries`` times.
Tensors whose sample would hold fewer than ``MIN_SAMPLES`` entries use an exact top-k instead.
The result reports itself through ``selected`` vs `target_count`; it is near k, not exactly k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, CountedSparsifier, gather, gpu_kernels
from sparsecomm.sparsify.threshold import indices_at_or_above

MIN_SAMPLES = 100


def sampled_threshold(flat: torch.Tensor, k: int, sample: float,
                      generator: torch.Generator | None) -> float | torch.Tensor:
    """The smallest of the top ceil(samples·k/numel) magnitudes of a strided sample of about
    ``sample`` of ``flat`` (random start from ``generator``): a threshold that about k entries pass.
    On a GPU it stays there, a 0-d tensor, so that no host round trip waits for it."""
    numel = flat.numel()
    stride = max(1, round(1.0 / sample))
    if flat.device.type == "cuda":
        return device_sampled_threshold(flat, k, stride, generator)
    start = int(sample_start(numel, stride, generator, flat.device))
    samples = flat[start::stride].abs()
    top = min(samples.numel(), max(1, math.ceil(samples.numel() * k / numel)))
    return float(torch.topk(samples, top, sorted=False).values.min())


def sample_start(numel: int, stride: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Where a strided sample of ``numel`` entries begins: a 1-element int64 tensor on ``device``,
    drawn from ``generator`` below min(stride, numel) (0 without one, or with no stride)."""
    if generator is None or stride == 1:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return torch.randint(min(stride, numel), (1,), generator=generator, device=generator.device).to(device)


def device_sampled_threshold(flat: torch.Tensor, k: int, stride: int,
                             generator: torch.Generator | None) -> torch.Tensor:
    """`sampled_threshold` without leaving the device: numel // stride samples from a random start
    (two Triton launches where Triton is installed, `sparsecomm.sparsify.cuda_threshold`, whose
    threshold is the sample's rounded down to 8 significant bits; else torch's ops)."""
    numel = flat.numel()
    count = max(1, numel // stride)
    start = sample_start(numel, stride, generator, flat.device)
    top = min(count, max(1, math.ceil(count * k / numel)))
    if (kernels := gpu_kernels(flat, "cuda_threshold")) is not None:
        return kernels.top_sample_lower_edge(flat, start, count, stride, top)
    samples = flat[torch.arange(count, device=flat.device).mul_(stride).add_(start)].abs()
    return torch.topk(samples, top, sorted=False).values.min()


@SPARSIFIERS.register("dgc")
@dataclass(frozen=True)
class DGCThreshold(CountedSparsifier):
    sample: float = 0.01
    upper: float = 1.3
    lower: float = 0.8
    decay: float = 0.8
    retries: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.sample <= 1.0:
            raise SparseCommError("dgc sample must be in (0, 1]")
        if not (0.0 < self.lower <= 1.0 <= self.upper and 0.0 < self.decay < 1.0 and self.retries >= 0):
            raise SparseCommError("dgc needs 0 < lower <= 1 <= upper, 0 < decay < 1, retries >= 0")

    def sends_whole(self, shape: torch.Size, dense_below: int) -> bool:
        """As DGC's own code chooses: every matrix and kernel is sparsified, whatever its size;
        vectors (biases, norms' scales) go whole."""
        return len(shape) <= 1

    def selects_rows(self) -> bool:
        """Yes: DGC's code meets an embedding's gradient as the dense matrix PyTorch gives by
        default, and sparsifies it as any other matrix."""
        return True

    def sampled_threshold(self, flat: torch.Tensor, k: int,
                          generator: torch.Generator | None) -> float | torch.Tensor:
        return sampled_threshold(flat, k, self.sample, generator)

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        flat = tensor.reshape(-1)
        k = self.target_count(flat.numel())
        if k == 0:
            return gather(tensor, torch.zeros(0, dtype=torch.int64, device=flat.device))
        if flat.numel() * self.sample < MIN_SAMPLES:  # too small to sample well; exact is cheap here
            return gather(tensor, torch.topk(flat.abs(), k, sorted=False).indices)
        threshold = self.sampled_threshold(flat, k, generator)
        return gather(tensor, refined_selection(flat, k, threshold, self.lower, self.upper, self.decay, self.retries))


def refined_selection(flat: torch.Tensor, k: int, threshold: float | torch.Tensor, lower: float, upper: float,
                      decay: float, retries: int, in_order: bool = False) -> torch.Tensor:
    """Indices of the entries of ``flat`` at or above an estimated ``threshold``, corrected towards
    k: lowered by ``decay`` while fewer than ``lower``·k pass (at most ``retries`` times), and cut
    when more than ``upper``·k pass — to k by a top-k, or with ``in_order`` to the k largest
    magnitudes in index order (ties at the k-th in index order too; no sort needed later). An entry
    of magnitude 0 is never among those cut to: where fewer than k are nonzero, fewer are kept."""
    indices = indices_at_or_above(flat, threshold).to(flat.device)
    for _ in range(retries):
        if indices.numel() >= lower * k or threshold == 0.0:
            break
        threshold = threshold * decay
        indices = indices_at_or_above(flat, threshold).to(flat.device)
    if indices.numel() > upper * k:
        magnitudes = flat[indices].abs()
        top = torch.topk(magnitudes, k, sorted=False)
        if in_order:  # those above the k-th magnitude, then its ties in index order up to k; never a zero
            kth = top.values.min()
            above, tied = magnitudes > kth, (magnitudes == kth) & (kth > 0)
            return indices[above | (tied & (tied.cumsum(0) <= k - above.sum()))]
        return indices[top.indices[top.values > 0]]  # a zero sends nothing
    return indices
