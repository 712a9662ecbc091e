"""The words and settings of the ``adaptive`` controller: a step's `Mode`, its `Plan`, and the
frozen `AdaptiveConfig` every rule of the controller reads its constants from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.names import Name

FP16_MAX = float(torch.finfo(torch.float16).max)
"""fp16's largest finite value"""


class Mode(Name):
    """How a step sends its gradient: every entry in fp32 or in fp16 (a *dense* step), or its
    largest entries — with the pipeline's own codecs (``sparse``) or on the device route, in its
    device form (``device``, `sparsecomm.device.support.device_form`) — or each matrix as a
    low-rank product (``low rank``, PowerSGD: the sparse steps' form where ``adaptive(low_rank=r)``
    asks for it, `sparsecomm.reducer.paths.low_rank`)."""

    FP32 = "fp32"
    FP16 = "fp16"
    SPARSE = "sparse"
    DEVICE = "device"
    LOW_RANK = "low rank"

    @property
    def dense(self) -> bool:
        """Whether every entry is sent."""
        return self in (Mode.FP32, Mode.FP16)

    @property
    def selects(self) -> bool:
        """Whether the step sends a selection of entries (on either route): what the density,
        the gradient's energy and the sparse path's costs are about."""
        return self in (Mode.SPARSE, Mode.DEVICE)

    @property
    def exactness(self) -> int:
        """0 for the most exact mode: fp16 rounds what fp32 sends whole, a sparse or low-rank step
        holds back all it leaves in the feedback (on either route alike)."""
        return min(list(Mode).index(self), list(Mode).index(Mode.SPARSE))


@dataclass(frozen=True)
class Plan:
    """What one step sends: a `Mode`, and for sparse steps the density of the budgeted entries."""

    mode: Mode
    density: float = 1.0

    @property
    def dense(self) -> bool:
        return self.mode.dense


@dataclass(frozen=True)
class AdaptiveConfig:
    """The controller's constants (the defaults hold for every workload measured; tests set others)."""

    min_wire_bytes: int = 64 * 1024
    """dense calls smaller than this say more about latency than throughput: not measured"""
    first_bytes_per_nnz: float = 3.0
    """bytes per entry assumed before the first sparse step (a value and a near-entropy index)"""
    max_sparse_density: float = 0.25
    """a budget that buys more than this is a fast link: sparse steps stop here (their payload is
    still about 6x smaller than dense's) and the dense modes are the alternative"""
    fp16_headroom: float = 8.0
    """how far below `FP16_MAX` the largest magnitude sent must stay for fp16 steps"""
    fp16_margin: float = 0.10
    """how much cheaper than an fp32 step an fp16 step must be to be chosen"""
    sparse_margin: float = 0.10
    """how much cheaper than the dense modes a sparse or low-rank step must be to be chosen: what it
    leaves in the feedback arrives steps later, so a step that saves little time is not worth the
    delay"""
    warmup_steps: int = 3
    """the first steps are slow for reasons of their own (allocation, DDP's first iteration): their
    costs are not counted"""
    exploration_steps: int = 2
    """sparse steps before the sparse path's cost counts (the first is a warm-up)"""
    explore_density: float = 0.03
    """the density of the sparse steps sent while the sparse path's cost is unknown (the first
    few; at least the step's least density): at the floor such a step would hold back nearly all
    of a gradient at the start of training, where it is largest, for the feedback to deliver in
    one burst steps later; a few percent is about where the later steps settle on the models
    measured, and costs those few steps little on any link"""
    explore_between: float = 3.0
    """while the sparse path's cost is unknown, a sparse step is followed by a dense one where a
    dense step is predicted to cost at most this many sparse steps (their overhead counted as
    none): there a dense step may well be the faster, and the gradient an exploring sparse step
    held back goes out one step later, not after several at the start of training, where the
    gradient is largest; on a slower link the exploring steps run on end, as they always do at 0"""
    explore_share: float = 0.02
    """a challenger is tried again once its trial's predicted extra cost is this share of the
    steps' time since its last trial"""
    min_reexplore: int = 30
    """and at most once every this many steps"""
    trial_pairs: int = 3
    """a trial runs the challenger this many times, each followed by a step of the incumbent"""
    clear_win: float = 1.5
    """one trial decides alone only where the challenger beat the incumbent (with the margins) by
    this factor in every pair: a step's time varies by ±50% and more from one step to the next, so
    three pairs barely past the margin come by chance; a smaller win needs the typical pair of two
    trials"""
    pair_window: int = 12
    """per pair of modes, how many of their latest paired step ratios a close call is judged by"""
    trial_patience: int = 6
    """steps after a trial's last step within which its reports are expected; a trial still
    missing some then is decided on those it has (or, with none of a mode, left undecided)"""
    energy_samples: int = 1 << 14
    """about this many entries of a step's gradient are sampled for its energy curve"""
    energy_every: int = 4
    """on every this many sparse steps (a curve changes slowly, and reading one costs a tenth of a
    small model's step), and on each until the first preferred density is known"""
    density_candidates: int = 64
    """the densities between the floor and `max_sparse_density` (log-spaced) a rank picks from"""
    compute_window: int = 9
    """compute times and preferred densities: medians over this many agreed measurements"""
    throughput_window: int = 3
    """link throughputs: medians over this many"""
    cost_window: int = 12
    """a mode's step cost: the interquartile mean of this many (`typical`)"""
    every_step_reports: int = 8
    """the first steps' reports are always heard, even when one must go in a collective of its own"""
    report_every: int = 4
    """after them, every this many steps' are"""
    calibration_numel: int = 1 << 20
    """the synthetic gradient the sparse path's per-byte cost is timed on at start-up"""
    calibration_nnz: tuple[int, int] = (2_000, 128_000)
    """the small and the large selection whose difference gives that cost"""

    def __post_init__(self) -> None:
        if self.trial_pairs < 1 or self.pair_window < 2 * self.trial_pairs:
            raise SparseCommError("adaptive: trial_pairs must be >= 1 and pair_window >= 2 * trial_pairs")
        if not 0.0 < self.max_sparse_density <= 1.0:
            raise SparseCommError("adaptive: max_sparse_density must be in (0, 1]")
        if not 0.0 <= self.explore_density <= self.max_sparse_density:
            raise SparseCommError("adaptive: explore_density must be in [0, max_sparse_density] (0: the floor)")
        if self.explore_between < 0.0:
            raise SparseCommError("adaptive: explore_between must be >= 0 (0: exploring steps run on end)")
        if min(self.compute_window, self.throughput_window, self.cost_window, self.energy_every,
               self.report_every, self.density_candidates) < 1:
            raise SparseCommError("adaptive: windows, cadences and candidates must be >= 1")
        small, large = self.calibration_nnz
        if not 0 < small < large <= self.calibration_numel:
            raise SparseCommError("adaptive: calibration_nnz must be two increasing counts within calibration_numel")

    def margin(self, mode: Mode) -> float:
        """What a step in ``mode`` must save to be chosen over a more exact one."""
        return {Mode.FP16: self.fp16_margin, Mode.SPARSE: self.sparse_margin, Mode.DEVICE: self.sparse_margin,
                Mode.LOW_RANK: self.sparse_margin}.get(mode, 0.0)

    def win_threshold(self, challenger: Mode, incumbent: Mode) -> float:
        """The largest ratio of a challenger's step time to the incumbent's at which it wins: a less
        exact mode must save its own margin over a more exact one (sparse 10% on fp16 as on fp32),
        and a more exact one wins unless it costs more than the less exact one's margin; of two as
        exact (a sparse step's two routes), the cheaper wins."""
        if challenger.exactness == incumbent.exactness:
            return 1.0
        if challenger.exactness > incumbent.exactness:
            return 1 / (1 + self.margin(challenger))
        return 1 + self.margin(incumbent)
