"""``adaptive``: the largest entries, as many as this step's plan asks for.

Inside a `GradientReducer` the density is set every step by the reducer's adaptive controller (see
`sparsecomm.adaptive`) from the measured link, compute and gradient, as every tensor's
floor (`sparsecomm.sparsify.shared_threshold` adds the entries that stand above the rest of the
model); ``budget``, ``floor``, ``probe``, ``dense_start``, ``warmup``, ``low_rank`` and ``horizon`` are that
controller's settings, and ``device_route`` where its sparse steps may go on the device route
(`sparsecomm.device.support.device_form`). Used alone, it keeps ``density``.

Selection: a threshold estimated from a strided sample (as DGC's), then one pass; if that selects
more than ``UPPER``·k, the threshold is raised to the k-th largest of the selected magnitudes, and
if fewer than ``LOWER``·k it is lowered. The selection is never re-ordered, so it stays in index
order and encoding needs no sort. A budget needs bytes near k, not exactly k.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS, Sparsifier, count_from, gather
from sparsecomm.sparsify.dgc_threshold import refined_selection, sampled_threshold

WARMUP = 20
"""steps over which the least density falls to the floor under an optimizer that normalizes the
gradient (``warmup=-1``)"""
NORMALIZED_RANK = 8
"""the rank of the low-rank steps under an optimizer that normalizes the gradient (``low_rank=-1``)"""
FLOOR, NORMALIZED_FLOOR = 0.001, 0.05
"""the least density (``floor=0``): under SGD, and under an optimizer that normalizes the gradient,
where an entry held back many steps arrives as a burst its second moment remembers"""
MIN_SAMPLES = 256
"""below this many samples a tensor is small enough for an exact top-k"""
UPPER, LOWER, DECAY, RETRIES = 1.5, 0.7, 0.7, 4
DEVICE_ROUTES = ("accelerator", "any", "never")
"""where a reducer weighs the device route against the pipeline's codecs (``device_route``)"""


@SPARSIFIERS.register("adaptive")
@dataclass(frozen=True)
class Adaptive(Sparsifier):
    budget: int = 0
    """bytes one rank may send per step, whole model; 0: from the measured link and compute time"""
    floor: float = 0.0
    """the least density the budget may set; 0: by the optimizer — `NORMALIZED_FLOOR` under one that
    normalizes the gradient (each entry then waits at most a few dozen steps), `FLOOR` under SGD
    (`check_optimizer` tells it; untold, `FLOOR`)"""
    probe: int = 200
    """with a measured budget, every ``probe`` steps one step is sent dense to re-measure the link (0: never)"""
    dense_start: int = 0
    """with a measured budget, the first ``dense_start`` steps send every entry in fp32"""
    warmup: int = -1
    """with a measured budget, over the first ``warmup`` steps the least density falls geometrically
    from `AdaptiveConfig.max_sparse_density` to the floor, as DGC's warm-up training raises the
    sparsity exponentially (§3.3); -1: by the optimizer — `WARMUP` under one that normalizes the
    gradient (Adam's kin: what error feedback holds back arrives later in one burst, which its second
    moment remembers for many steps), 0 under SGD, whose update is linear in the gradient
    (`check_optimizer` tells it; untold, 0)"""
    low_rank: int = -1
    """with a measured budget and ``residual`` feedback, the compressed steps send each matrix as a
    product of this rank (PowerSGD) rather than their largest entries — far fewer bytes and far
    less selecting and coding — weighed against fp32 and fp16 steps by the same trials; 0: none;
    -1: by the optimizer — `NORMALIZED_RANK` under one that normalizes the gradient (AdamW and its
    kin, under which a sparse step's held-back entries arrive as bursts its second moment
    remembers, where low-rank steps trained a transformer as far as dense: the guide's figures),
    none under SGD (`check_optimizer` tells it; untold, none)"""
    horizon: float = 0.0
    """with a measured budget, a step's k entries are taken to deliver what the ``horizon``·k largest
    of one step's gradient hold: error feedback sends what a step leaves out some steps later
    (0: the feedback's `Feedback.delay_horizon`, 1/(1 − m) for DGC's momentum m, else 1)"""
    sample: float = 0.01
    """fraction of the entries sampled for the threshold"""
    density: float = 1.0
    """the fraction kept when no reducer sets one"""
    device_route: str = "any"
    """where a reducer's sparse steps may take the device route in the pipeline's device form,
    the trials choosing it over the pipeline's codecs where its steps are faster: ``any`` (on
    CPUs and GPUs), ``accelerator`` (only where every rank's gradients are off the host, where the
    codecs cost copies and reads of the device) or ``never``"""

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise SparseCommError("adaptive budget must be >= 0 bytes (0: measured)")
        if not 0.0 <= self.floor <= 1.0 or not 0.0 < self.density <= 1.0:
            raise SparseCommError("adaptive floor must be in [0, 1] (0: by the optimizer) and density in (0, 1]")
        if self.probe < 0:
            raise SparseCommError("adaptive probe must be >= 0 steps")
        if self.dense_start < 0:
            raise SparseCommError("adaptive dense_start must be >= 0 steps")
        if self.warmup < -1:
            raise SparseCommError("adaptive warmup must be >= 0 steps, or -1 (by the optimizer)")
        if self.low_rank < -1:
            raise SparseCommError("adaptive low_rank must be >= 1 (a matrix rank), 0 (none) or -1 (by the optimizer)")
        if not (self.horizon == 0.0 or self.horizon >= 1.0):
            raise SparseCommError("adaptive horizon must be >= 1 step, or 0 (from the feedback)")
        if not 0.0 < self.sample <= 1.0:
            raise SparseCommError("adaptive sample must be in (0, 1]")
        if self.device_route not in DEVICE_ROUTES:
            raise SparseCommError(f"adaptive device_route must be one of {', '.join(DEVICE_ROUTES)}")

    @property
    def least(self) -> float:
        """The least density the budget may set: ``floor``, or `FLOOR` where it is left to the optimizer."""
        return self.floor if self.floor > 0 else FLOOR

    def least_at(self, step: int, top: float) -> float:
        """The least density at ``step``: ``top`` over the first ``warmup`` steps, then falling
        geometrically to `least` over as many more."""
        if step >= 2 * self.warmup or top <= self.least:
            return self.least
        return top * (self.least / top) ** (max(0, step - self.warmup) / self.warmup)

    def at_density(self, density: float) -> Adaptive:
        """The same sparsifier keeping ``density`` (clamped to [`least`, 1])."""
        return replace(self, density=min(1.0, max(self.least, density)))

    def target_count(self, numel: int) -> int:
        return count_from(numel, self.density, None)

    def sparsify(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> SparseGradient:
        flat = tensor.reshape(-1)
        numel = flat.numel()
        k = self.target_count(numel)
        if k >= numel:
            return SparseGradient.from_dense(tensor)
        if k == 0:
            return gather(tensor, torch.zeros(0, dtype=torch.int64, device=flat.device))
        stride = max(1, round(1.0 / self.sample))
        if numel // stride < MIN_SAMPLES:  # too small to sample well; an exact top-k is cheap here
            return gather(tensor, torch.topk(flat.abs(), k, sorted=False).indices.sort().values)
        threshold = sampled_threshold(flat, k, self.sample, generator)
        return gather(tensor, refined_selection(flat, k, threshold, LOWER, UPPER, DECAY, RETRIES, in_order=True))
