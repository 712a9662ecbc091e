"""`LinkBudget`: what each step of an ``adaptive`` pipeline sends — the whole gradient where the link
carries it while the step computes, otherwise its largest entries at the density that moves the
most gradient energy per second of step — and in which of three forms.

Every step, each rank measures:

- its compute time C: forward and backward — from the start of the model's forward pass (a forward
  pre-hook marks it) to the step's last call, less sparsecomm's own local stages. Without a model
  to hook, the step's whole wall time until the next step less communication waits and local
  stages, known one step later;
- the link's throughput β: wire bytes per second of its large dense all_reduce calls (a ring
  all_reduce puts 2(P−1)/P of the tensor on each rank's link), and of one fp32 probe at start-up.
  Of a step's, the fastest rank's: a call's time on a rank includes its wait for the ranks that
  post theirs later, the last to post waits for the link alone;
- on every `ENERGY_EVERY`-th sparse step, the energy curve of a strided sample of its gradient
  (`sparsecomm.integration.gradient_energy`), from which it reports the density it prefers (below);
- the payload bytes per entry its density budgeted (tensors may send more than the density,
  `sparsecomm.sparsify.shared_threshold`: their extra counts here), the bytes it sent outside the
  budget (tensors below ``dense_below``, parameters sent whole, sparse embedding rows), and the
  largest magnitude it sent;
- the step's whole time: its compute plus the time it waited for communication plus sparsecomm's
  local stages — for a sparse step less its payloads' wire time and their calibrated per-byte cost
  (below): what remains beyond the compute is the sparse path's fixed overhead O_s (passes over the
  gradient, the codecs' per-call costs, agreement, handoffs), which the plan adds back at any budget.

Once, before the first step, each rank also times its sparse path (`marginal_sparse_cost`): the
extra seconds per payload byte on the sender (selecting, feedback, encoding) and on a receiver
(decoding, adding into the sum), the slope between a small and a large synthetic selection. Only
that slope counts per byte — what a step costs at any budget (a pass over the whole gradient, a
call's overhead) is the same at any budget, and counting it per byte would make small budgets
look dear and shrink them further.

When a step ends each rank reports these numbers; the report rides on the next step's first call
(`sparsecomm.integration.reports`: in its agreement record or a tail of its all_reduce), every rank
takes the maximum over the ranks, and the step after next reads it (the very first report goes
alone and is read at once). So every rank plans alike — from the slowest compute, the link, the
dearest payloads and codecs, the largest magnitude, and each mode's steps as long as their slowest
rank's — and after the first step no report needs a collective of its own.

Each step runs in one of three modes:

- **sparse**: the largest entries at density d of the N budgeted entries, between ``floor`` and
  `MAX_SPARSE_DENSITY`: the median of the last densities the ranks preferred (each step, the
  largest of its ranks' preferences). A rank prefers the d whose entries carry the most of its
  gradient's energy per second of step, E(min(1, H·d)) / (C + O_s + κ·bytes(d)) (`energy_density`):
  E the share of the sampled gradient's sum of squares its largest entries hold, H the horizon
  within which error feedback delivers what a step leaves out (1/(1 − m) steps for DGC's momentum
  m), bytes(d) = fixed bytes + d·N·(bytes per budgeted entry), κ = κ_e + (P−1)(κ_d + 1/β) seconds per byte
  (every rank selects and encodes its payload, receives the P−1 others and decodes them; κ_e and
  κ_d are the calibrated seconds per byte). Before any preference is known: what the link and
  codecs carry while the step computes, B = C / κ bytes less the fixed bytes. It costs O_s + κ·bytes(d);
- **dense** (fp32): a plain all_reduce, each tensor's feedback flushed into it: exact;
- **half** (fp16): the same, scaled by 1/P and cast to fp16 (as DDP's fp16 hook does); error
  feedback keeps what the cast rounded away, DGC's momentum (which moves to the average on dense
  steps) rounds as the hook does. Allowed while the largest magnitude sent leaves `HALF_HEADROOM`
  of fp16's range; until measured itself, it costs fp32's time (measured or predicted) with fp16's
  wire in place of fp32's, at the throughput of an fp16 all_reduce probed at start-up (on a slow
  link half fp32's wire time; on a fast one gloo's fp16 sums can make it as long). It need not wait
  for fp32 to be timed: where it is predicted cheapest it runs first, and fp32 then challenges it by
  trial like any other mode.

The reducer runs both dense modes as DDP's own hooks do: one asynchronous all_reduce per bucket, no
agreement step (a rank's non-finite gradient travels as NaN, so every rank sees the same non-finite
sum and raises together). The first step runs sparse at the ``floor`` density when the link was
timed at start-up (`sparsecomm.integration.link_probe`), dense otherwise (to measure it). A step is
dense on every ``probe``-th step (to measure again), and whenever the link carries the whole fp32
gradient within the compute time.
Otherwise steps run in the *incumbent* mode, first the cheapest predicted. Modes are compared by
whole steps: a dense mode's cost is the interquartile mean (`typical`) of its last steps' whole
times — its collectives' own work may slow the compute it overlaps (gloo sums fp16 on the processor
that runs the backward) — and until fp32 has run, the compute plus its wire time at the measured
throughput; a sparse step's is the compute plus O_s plus its per-byte cost at its density. Until
sparse steps have been measured O_s counts as 0, so a link slower than the compute gets sparse
steps at the ``floor`` density — the first warms the sparse path up and is not counted — until
their cost is known, cheaply where sparse does not pay.

The incumbent changes only by a *trial*: a challenger mode runs `TRIAL_PAIRS` times, each step
followed by one of the incumbent, and wins if it was `CLEAR_WIN` times cheaper than the incumbent's
step after it in every pair of the trial, or cheaper in the `typical` pair of the pair's last trials
(at least two trials' worth, `PAIR_WINDOW`) — a less exact mode by its margin over a more exact one
(`win_threshold`): half by `HALF_MARGIN` over fp32, sparse by `SPARSE_MARGIN` over either (what it
leaves in the feedback arrives later). A first trial that won but not clearly, or was split by
one stalled step, runs again at once. Steps of a machine shared with others are slower for whole
seconds at a time; modes measured at different times would be ranked by the machine's mood, steps
side by side are not. A challenger's trial is due once its extra cost over its trial — as the pair's
earlier trials measured it, or as predicted for a pair never compared — is `EXPLORE_SHARE` of the
steps' time since the pair was last compared, and never sooner than `MIN_REEXPLORE` steps after (a
mode never compared: at once where the share allows): close calls are re-checked often, a mode that
lost clearly waits in proportion, and on a slow link dense is rarely tried beyond the probes. Of the
modes due, the cheapest predicted goes first. A step whose mode differs from the step before's, and
every step of a trial, is always heard, even when its report must go alone.

A user-set ``budget`` (bytes per step) replaces B and the preferred density, and turns the probes
off: bytes alone decide the mode then (dense, half or sparse, whichever the budget holds) and a run repeats bit for
bit.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from sparsecomm.integration.gradient_energy import energy_share
from sparsecomm.sparsify.adaptive import Adaptive

MIN_WIRE_BYTES = 64 * 1024
"""dense calls smaller than this say more about latency than throughput: not measured"""
FIRST_BYTES_PER_NNZ = 3.0
"""bytes per nonzero assumed before the first sparse step (a value and a near-entropy index)"""
MAX_SPARSE_DENSITY = 0.25
"""a budget that buys more than this is a fast link: sparse steps stop here (their payload is still
about 6x smaller than dense's) and the dense modes are the alternative"""
HALF_RANGE, HALF_HEADROOM, HALF_MARGIN = 65504.0, 8.0, 0.10
"""fp16's largest finite value; how far below it the largest magnitude must stay for fp16 steps;
how much cheaper than an fp32 step an fp16 step must be to be chosen"""
SPARSE_MARGIN = 0.10
"""how much cheaper than the dense modes a sparse step must be to be chosen: what it leaves in the
feedback arrives steps later, so a step that saves little time is not worth the delay"""
WARMUP_STEPS = 3
"""the first steps are slow for reasons of their own (allocation, DDP's first iteration): their
costs are not counted"""
EXPLORATION_STEPS = 2
"""sparse steps before the sparse path's cost counts (the first is a warm-up)"""
EXPLORE_SHARE, MIN_REEXPLORE = 0.02, 30
"""a challenger is tried again once its trial's predicted extra cost is this share of the steps'
time since its last trial, and at most once every this many steps"""
TRIAL_PAIRS = 3
"""a trial runs the challenger this many times, each followed by a step of the incumbent"""
CLEAR_WIN = 1.5
"""one trial decides alone only where the challenger beat the incumbent (with the margins) by this
factor in every pair: a step's time here varies by ±50% and more from one step to the next, so three
pairs barely past the margin come by chance (fp16 against fp32 on loopback, 10% apart: 2 of 8 trials
in one run); a smaller win needs the typical pair of two trials"""
PAIR_WINDOW = 4 * TRIAL_PAIRS
"""per pair of modes, how many of their latest paired step ratios a close call is judged by"""
TRIAL_PATIENCE = 6
"""steps after a trial's last step within which its reports are expected; a trial still missing
some then is decided on those it has (or, with none of a mode, left undecided)"""
ENERGY_SAMPLES, ENERGY_EVERY, DENSITY_CANDIDATES = 1 << 14, 4, 64
"""about this many entries of a step's gradient sampled for its energy curve, on every this many
sparse steps (reading a curve costs ~0.3 ms, a tenth of a small model's step; it changes slowly); the
densities between ``floor`` and `MAX_SPARSE_DENSITY` (log-spaced) among which a rank picks its
preferred one"""
COMPUTE_WINDOW, THROUGHPUT_WINDOW, COST_WINDOW = 9, 3, 12
"""compute and throughput: medians over this many agreed measurements; a mode's cost: the
interquartile mean of this many (`typical`: steps vary widely and now and then by several times —
the least would flatter a mode, as fp16 on gloo; a median of a few is as noisy as its samples)"""
DENSE, HALF, SPARSE = "dense", "half", "sparse"
Density = TypeVar("Density", float, torch.Tensor)


EXACTNESS = (DENSE, HALF, SPARSE)
"""the modes from the most exact: fp16 rounds what fp32 sends whole, sparse holds back all it leaves
in the feedback"""


def margin(mode: str) -> float:
    """What a step in ``mode`` must save to be chosen over a more exact one."""
    return {HALF: HALF_MARGIN, SPARSE: SPARSE_MARGIN}.get(mode, 0.0)


def win_threshold(challenger: str, incumbent: str) -> float:
    """The largest ratio of a challenger's step time to the incumbent's at which it wins: a less
    exact mode must save its own margin over a more exact one (sparse 10% on fp16 as on fp32), and a
    more exact one wins unless it costs more than the less exact one's margin."""
    if EXACTNESS.index(challenger) > EXACTNESS.index(incumbent):
        return 1 / (1 + margin(challenger))
    return 1 + margin(incumbent)


@dataclass(frozen=True)
class Plan:
    """What one step sends: ``dense`` (fp32, exact), ``half`` (fp16, scaled by 1/P) or ``sparse``
    at ``density``."""

    mode: str
    density: float = 1.0

    @property
    def dense(self) -> bool:
        """Whether every entry is sent (fp32 or fp16)."""
        return self.mode != SPARSE


@dataclass
class Trial:
    """A paired comparison of a ``challenger`` mode with the ``incumbent``: their steps alternate,
    so that the machine's slow spells (whole seconds in which every step is slower) hit both alike,
    and the two are judged by the ratios of adjacent steps (`ratios`)."""

    challenger: str
    incumbent: str
    to_run: list[str]
    """the modes of the trial's steps not yet run, in order"""
    running: dict[int, tuple[str, float]] = field(default_factory=dict)
    """step → (mode, density) of the trial's steps run and not yet reported"""
    costs: dict[int, tuple[str, float]] = field(default_factory=dict)
    """step → (mode, whole-step time) of the trial's steps reported"""
    last_step: int = 0

    def ratios(self) -> list[float]:
        """The challenger's step time over the incumbent's step right after it, for each such pair
        reported."""
        return [cost / self.costs[step + 1][1] for step, (mode, cost) in sorted(self.costs.items())
                if mode == self.challenger and self.costs.get(step + 1, ("", 0.0))[0] == self.incumbent]

    def state_dict(self) -> dict[str, Any]:
        return {"challenger": self.challenger, "incumbent": self.incumbent, "to_run": list(self.to_run),
                "running": {step: list(run) for step, run in self.running.items()},
                "costs": {step: list(cost) for step, cost in self.costs.items()}, "last_step": self.last_step}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Trial:
        return cls(state["challenger"], state["incumbent"], list(state["to_run"]),
                   {int(step): (run[0], float(run[1])) for step, run in state["running"].items()},
                   {int(step): (cost[0], float(cost[1])) for step, cost in state["costs"].items()}, state["last_step"])


@dataclass
class StepMeasurement:
    """What one rank saw during one step (filled by the reducer, read once the step ends)."""

    first_submit: float | None = None
    forward_start: float | None = None
    """when the model's forward pass of this step began (None: no model hooked)"""
    last_submit: float = 0.0
    last_done: float = 0.0
    local_s: float = 0.0
    first_issue: float | None = None
    """when the step's first dense all_reduce started"""
    wire_bytes: float = 0.0
    wire_s: float = 0.0
    """from the first large fp32 all_reduce's start to the last one's end"""
    payload_bytes: int = 0
    payload_nnz: int = 0
    whole_nnz: int = 0
    """nonzeros of parameters sent whole inside compressed calls (in ``payload_nnz`` too)"""
    planned_nnz: int = 0
    """the entries the step's density budgets in its compressed calls: its tensors may send more
    (`sparsecomm.sparsify.shared_threshold`), so the bytes per budgeted entry hold their extra"""
    fixed_bytes: int = 0
    """bytes of the calls outside the budget (small tensors, sparse rows)"""
    max_magnitude: float = 0.0
    """the largest |value| this rank sent (before any 1/P scaling)"""
    codec_cost: tuple[float, float] = (0.0, 0.0)
    """this rank's calibrated (κ_e, κ_d), carried by its reports"""
    total_numel: int = 0
    budget_numel: int = 0
    wants_energy: bool = False
    """whether this step samples its gradient's energy (`LinkBudget.begin_step` decides)"""
    energy_samples: list[torch.Tensor] = field(default_factory=list)
    """squares of a strided sample of the gradient's entries under the budget (`LinkBudget.sample_energy`)"""

    def forward_backward_s(self) -> float:
        """From the forward pass's start to the step's last call, less sparsecomm's local stages."""
        assert self.forward_start is not None
        return max(0.0, self.last_submit - self.forward_start - self.local_s)

    def compute_s(self, next_start: float) -> float:
        """Without a forward hook: from this step's first call to the next step's first call, less
        the communication it waited for and sparsecomm's local stages."""
        assert self.first_submit is not None
        waited = max(0.0, self.last_done - self.last_submit)
        return max(0.0, next_start - self.first_submit - waited - self.local_s)


CALIBRATION_NUMEL, CALIBRATION_SIZES = 1 << 20, (2_000, 128_000)


def marginal_sparse_cost(spec: Any, repeats: int = 5) -> tuple[float, float]:
    """(sender, receiver) seconds per payload byte that the whole sparse path adds between a small
    and a large selection of a synthetic 1M-element gradient: on the sender, the pipeline's step
    (feedback, selection, encoding, the feedback's update); on a receiver, decoding a payload and
    adding it into the sum. The slope, not the average: what a step costs at any budget (a pass
    over the whole gradient, a call's overhead) cancels out."""
    from sparsecomm.payload import decode
    from sparsecomm.pipeline import Pipeline

    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(CALIBRATION_NUMEL, generator=generator)
    total = torch.zeros(CALIBRATION_NUMEL)
    pipelines = [Pipeline(spec) for _ in CALIBRATION_SIZES]

    def timed(pipeline: Pipeline, nnz: int) -> tuple[int, float, float]:
        start = time.perf_counter()
        payload = pipeline.step(gradient, "calibration", make_payload=True, density=nnz / CALIBRATION_NUMEL).payload
        middle = time.perf_counter()
        assert payload is not None
        received = decode(payload, expect=CALIBRATION_NUMEL)
        total.scatter_add_(0, received.indices, received.values)
        return len(payload), middle - start, time.perf_counter() - middle

    for _ in range(2):  # warm, untimed: a first call allocates and pages in what later ones reuse
        for pipeline, nnz in zip(pipelines, CALIBRATION_SIZES, strict=True):
            timed(pipeline, nnz)
    best = [(0, math.inf, math.inf) for _ in CALIBRATION_SIZES]
    for _ in range(repeats):  # the sizes alternate, so a slow spell of the machine hits both alike
        for which, (pipeline, nnz) in enumerate(zip(pipelines, CALIBRATION_SIZES, strict=True)):
            size, send_s, receive_s = timed(pipeline, nnz)
            best[which] = (size, min(best[which][1], send_s), min(best[which][2], receive_s))
    (small, send_small, receive_small), (large, send_large, receive_large) = best
    span = max(1, large - small)
    return max(0.0, (send_large - send_small) / span), max(0.0, (receive_large - receive_small) / span)


def typical(samples: deque[float]) -> float:
    """The interquartile mean: the mean of the middle half of the samples, steadier than a median of
    few and blind to the odd step that a scheduling hiccup made several times longer. Below four
    samples there is no quarter to cut: their median (a mean would take a hiccup in whole)."""
    ordered = sorted(samples)
    if len(ordered) < 4:
        return statistics.median(ordered)
    cut = len(ordered) // 4
    middle = ordered[cut:len(ordered) - cut]
    return sum(middle) / len(middle)


def _window(size: int) -> Any:
    return field(default_factory=lambda: deque(maxlen=size))


@dataclass
class LinkBudget:
    """The ``adaptive`` sparsifier's plan for one `GradientReducer` (which owns it, drives it step by
    step and checkpoints it): measurements in, a `Plan` per step out."""

    sparsifier: Adaptive
    world_size: int
    feedback_horizon: float = 1.0
    """the pipeline's `Feedback.delay_horizon` (the reducer tells it): the horizon unless the
    sparsifier sets one"""
    step: int = 0
    total_numel: int = 0
    """elements reduced per step (all tensors): the dense all_reduce's size (before the first step:
    the model's, where the reducer knows it)"""
    budget_numel: int = 0
    """elements under the adaptive sparsifier per step"""
    compute_s: deque[float] = _window(COMPUTE_WINDOW)
    throughput: deque[float] = _window(THROUGHPUT_WINDOW)
    """β: wire bytes per second of the start-up probe's fp32 all_reduce and of the steps' dense ones"""
    half_throughput: deque[float] = _window(THROUGHPUT_WINDOW)
    """the same of an fp16 all_reduce, probed at start-up: fp16's wire until its steps are timed"""
    dense_cost_s: deque[float] = _window(COST_WINDOW)
    """what communicating cost an fp32 dense step (waiting plus local stages)"""
    half_cost_s: deque[float] = _window(COST_WINDOW)
    """the same for an fp16 dense step"""
    sparse_overhead_s: deque[float] = _window(COST_WINDOW)
    """O_s: what communicating cost a sparse step beyond its payloads' wire time and per-byte cost"""
    preferred_density: deque[float] = _window(COMPUTE_WINDOW)
    """the densities the steps' gradients preferred (`energy_density`; of each step, the ranks' largest)"""
    bytes_per_nnz: float = FIRST_BYTES_PER_NNZ
    """payload bytes per entry the density budgets (what the tensors sent above it included)"""
    fixed_bytes: float = 0.0
    encode_per_byte: float = 0.0
    decode_per_byte: float = 0.0
    """κ_e, κ_d: the slowest rank's calibrated marginal seconds per payload byte, sending and receiving"""
    codec_cost: tuple[float, float] = (0.0, 0.0)
    """this rank's own calibrated (κ_e, κ_d) (`calibrate`), carried by every report"""
    max_magnitude: float = math.inf
    """the largest |value| any rank sent lately (unknown: fp16 not allowed)"""
    current: Plan = Plan(DENSE)
    switched: bool = False
    """whether this step's mode differs from the step before's: its cost must reach a report"""
    measuring: StepMeasurement = field(default_factory=StepMeasurement)
    finished: StepMeasurement | None = None
    last_compute_s: float = 0.0
    """the finished step's compute time, known once the next step starts (without a forward hook)"""
    sparse_steps: int = 0
    reports_read: int = 0
    incumbent: str | None = None
    """the mode steps run in outside trials (None: not chosen yet)"""
    trial: Trial | None = None
    last_trial: dict[str, int] = field(default_factory=dict)
    """the step each mode's last trial (as challenger or incumbent) was decided"""
    rematch: str | None = None
    """a challenger whose first trial was split (most pairs won, one lost): tried again at once"""
    pair_ratios: dict[tuple[str, ...], deque[float]] = field(default_factory=dict)
    """per pair of modes (in name order), the first's step time over the second's in their trials' pairs"""
    mode_steps: dict[str, int] = field(default_factory=dict)
    """how many steps ran in each mode"""

    # -- the reducer's calls, in step order ------------------------------------------------------
    def calibrate(self, spec: Any) -> None:
        """Time this rank's sparse path once (`marginal_sparse_cost`); every report carries the result."""
        self.codec_cost = marginal_sparse_cost(spec)

    def observe_link(self, throughput: float, half_throughput: float | None = None) -> None:
        """The link's throughput in fp32 (and fp16), probed at start-up (`link_throughput`; the same
        on every rank)."""
        self.throughput.append(throughput)
        if half_throughput is not None:
            self.half_throughput.append(half_throughput)

    def sample_energy(self, gradient: torch.Tensor, spans: list[tuple[int, int]]) -> None:
        """Keep the squares of every stride-th entry of the ``(start, numel)`` spans of a flat
        gradient that the budget covers, this step's sample for `energy_density` (about
        `ENERGY_SAMPLES` of the model's entries; the offset turns with the step), where this step
        wants one (`StepMeasurement.wants_energy`)."""
        if not self.measuring.wants_energy:
            return
        stride = max(1, (self.total_numel or gradient.numel()) // ENERGY_SAMPLES)
        offset = self.step % stride
        for start, numel in spans:
            if numel > offset:
                self.measuring.energy_samples.append(
                    gradient[start + offset:start + numel:stride].detach().to(torch.float32).square())

    def begin_step(self, now: float, forward_start: float | None = None) -> Plan:
        """The first call of a step (whose forward pass began at ``forward_start``, when known):
        time the last step's compute if no forward hook did, and plan this step."""
        if self.finished is not None and self.finished.first_submit is not None:
            self.last_compute_s = self.finished.compute_s(now)
        self.finished = None
        self.measuring = StepMeasurement(first_submit=now, forward_start=forward_start, codec_cost=self.codec_cost)
        previous, self.current = self.current.mode, self.plan()
        self.switched = self.current.mode != previous
        # a preferred density matters only to sparse steps, and not to a user-set budget: dense
        # steps (on a fast link, all but a few trials) sample nothing
        self.measuring.wants_energy = (self.current.mode == SPARSE and self.sparse_steps % ENERGY_EVERY == 0
                                       and not self.sparsifier.budget)
        self.mode_steps[self.current.mode] = self.mode_steps.get(self.current.mode, 0) + 1
        return self.current

    def end_step(self) -> torch.Tensor:
        """The step ended: this rank's report, to be reduced by MAX over the ranks. Slots: compute
        time (of this step, or with no forward hook of the step before); the link throughput (MAX:
        the rank that waited least for the others to post measured the link); this step's whole
        time (compute and communicating) in its mode — fp32, fp16, or for sparse less its payloads'
        wire time and per-byte cost; then bytes per budgeted entry, bytes outside the budget and the
        largest magnitude sent; then the calibrated κ_e and κ_d; then the density this rank's
        gradient preferred (`energy_density`). Unmeasured: 0."""
        done = self.measuring
        self.finished = done
        self.total_numel, self.budget_numel = done.total_numel, done.budget_numel
        self.step += 1
        per_nnz = done.payload_bytes / done.payload_nnz if done.payload_nnz else 0.0
        fixed = done.fixed_bytes + done.whole_nnz * per_nnz
        selected = done.payload_nnz - done.whole_nnz
        per_budgeted = per_nnz * selected / done.planned_nnz if done.planned_nnz and selected > 0 else per_nnz
        cost = done.local_s + max(0.0, done.last_done - done.last_submit)
        compute = done.forward_backward_s() if done.forward_start is not None else self.last_compute_s
        costs = {DENSE: 0.0, HALF: 0.0, SPARSE: 0.0}
        if self.current.mode != SPARSE:
            if self.step > WARMUP_STEPS:
                # the whole step: where a collective's own work competes with the backward for the
                # processor (gloo's fp16 sums on a CPU), the compute it slowed counts against it
                costs[self.current.mode] = compute + cost
        else:
            self.sparse_steps += 1
            if self.sparse_steps >= EXPLORATION_STEPS and self.throughput:
                sent = done.payload_bytes + done.fixed_bytes
                wire = (self.world_size - 1) * sent / statistics.median(self.throughput)
                encode_per_byte, decode_per_byte = done.codec_cost
                codecs = (encode_per_byte + (self.world_size - 1) * decode_per_byte) * done.payload_bytes
                costs[SPARSE] = max(1e-6, compute + cost - wire - codecs)
        throughput = done.wire_bytes / done.wire_s if done.wire_s > 0 else 0.0
        preferred = self.energy_density(done.energy_samples)
        return torch.tensor([compute, throughput, costs[DENSE], costs[HALF],
                             costs[SPARSE], per_budgeted, fixed, done.max_magnitude, *done.codec_cost, preferred],
                            dtype=torch.float64)

    def observe(self, agreed: torch.Tensor, step: int | None = None) -> None:
        """Every rank's report of one step (``step``, when known), reduced by MAX (see `end_step`):
        a step takes as long as its slowest rank."""
        compute, link, dense, half, sparse, per_nnz, fixed, magnitude, encode, decode, preferred = agreed.tolist()
        self.reports_read += 1
        if compute > 0:
            self.compute_s.append(compute)
        if 0 < link < math.inf:  # a checkpoint's report from before 1c8a139 holds it negated, or +inf
            self.throughput.append(link)
        for window, whole in ((self.dense_cost_s, dense), (self.half_cost_s, half)):
            if whole > 0:
                window.append(whole)
        if sparse > 0:  # O_s: the slowest rank's sparse step beyond the slowest compute
            self.sparse_overhead_s.append(max(1e-6, sparse - compute))
        if per_nnz > 0:
            self.bytes_per_nnz, self.fixed_bytes = per_nnz, fixed
        if magnitude > 0:
            self.max_magnitude = magnitude
        if encode > 0 or decode > 0:
            self.encode_per_byte, self.decode_per_byte = encode, decode
        if preferred > 0:
            self.preferred_density.append(preferred)
        trial = self.trial
        if trial is not None and step is not None and step in trial.running:
            mode, density = trial.running.pop(step)
            whole = {DENSE: dense, HALF: half, SPARSE: sparse}[mode]
            if whole > 0 and mode == SPARSE and self.throughput:  # its payloads' wire and codec time back in
                whole += self.per_byte_s(statistics.median(self.throughput)) * self.step_bytes(density)
            if whole > 0:
                trial.costs[step] = (mode, whole)

    # -- the plan -------------------------------------------------------------------------------
    def plan(self) -> Plan:
        """This step's plan, from agreed numbers only (so every rank's is the same)."""
        if self.world_size == 1:
            return Plan(DENSE)
        if self.step == 0 and self.throughput and not self.sparsifier.budget:
            # the link probed at start-up, the compute not timed yet: sparse at the floor density,
            # cheap on any link, and a first sparse step warms the sparse path up
            return Plan(SPARSE, self.sparsifier.floor)
        dense_bytes = self.dense_bytes()
        if self.budget_numel == 0:
            if self.step == 0 and 0 < self.sparsifier.budget < dense_bytes / 2:
                # a user budget below fp16's bytes (the model's size told before the first step, what
                # the budget covers not yet measured): sparse from the start, at the floor density —
                # a dense first step would send the whole gradient over a link chosen too slow for it
                return Plan(SPARSE, self.sparsifier.floor)
            return Plan(DENSE)
        half_allowed = self.max_magnitude * HALF_HEADROOM < HALF_RANGE
        if self.sparsifier.budget:  # user-set: bytes alone decide, no timing
            fixed = self.sparsifier.budget
            if fixed >= dense_bytes:
                return Plan(DENSE)
            return Plan(HALF) if half_allowed and fixed >= dense_bytes / 2 else self._sparse(fixed)
        budget = self.step_budget()
        probing = self.sparsifier.probe and self.step > 0 and self.step % self.sparsifier.probe == 0
        if budget is None or budget >= dense_bytes or probing:
            return Plan(DENSE)
        costs = self._predicted_costs(budget, dense_bytes, half_allowed)
        if not self.sparse_overhead_s:  # the sparse path's cost unknown: learn it (cheap steps) before choosing
            return costs[SPARSE][1]
        self._decide_trial(costs)
        if self.incumbent not in costs:  # the first choice, or fp16 no longer allowed: the cheapest predicted
            self.incumbent = min(costs, key=lambda mode: costs[mode][0])
        trial = self.trial
        if trial is None:
            trial = self._due_trial(costs)
        if trial is not None and trial.to_run:
            mode = trial.to_run.pop(0)
            if mode in costs:
                plan = costs[mode][1]
                trial.running[self.step] = (mode, plan.density)
                trial.last_step = self.step
                return plan
            self.trial = None  # its mode is no longer allowed
        return costs[self.incumbent][1]

    def _predicted_costs(self, budget: float, dense_bytes: float, half_allowed: bool) -> dict[str, tuple[float, Plan]]:
        """Each allowed mode's predicted whole step times one plus its margin, and the plan that runs
        it (see the module docstring)."""
        throughput, compute = statistics.median(self.throughput), statistics.median(self.compute_s)
        dense_cost = typical(self.dense_cost_s) if self.dense_cost_s else compute + dense_bytes / throughput
        costs = {DENSE: (dense_cost, Plan(DENSE))}
        if half_allowed:
            # until timed: fp32's step with fp16's wire, at fp16's own probed throughput where known
            half_throughput = statistics.median(self.half_throughput) if self.half_throughput else throughput
            half_cost = (typical(self.half_cost_s) if self.half_cost_s
                         else dense_cost - dense_bytes / throughput + dense_bytes / 2 / half_throughput)
            costs[HALF] = (half_cost * (1 + HALF_MARGIN), Plan(HALF))
        exploring = not self.sparse_overhead_s
        if exploring:
            sparse = Plan(SPARSE, self.sparsifier.floor)
        elif self.preferred_density:
            sparse = Plan(SPARSE, self.sparsifier.at_density(statistics.median(self.preferred_density)).density)
        else:
            sparse = self._sparse(budget)
        carrying = self.per_byte_s(throughput) * self.step_bytes(sparse.density)
        overhead = typical(self.sparse_overhead_s) if not exploring else 0.0
        costs[SPARSE] = ((compute + carrying + overhead) * (1 + SPARSE_MARGIN) + 1e-9, sparse)
        return costs

    def _due_trial(self, costs: dict[str, tuple[float, Plan]]) -> Trial | None:
        """A trial of the cheapest predicted mode whose turn has come (`EXPLORE_SHARE`): its extra cost
        over its `TRIAL_PAIRS` steps is that share of the steps' time since its last trial, and at
        least `MIN_REEXPLORE` steps have passed since (a mode never in a trial: no such wait). The
        extra cost is what the pair's side-by-side steps measured (`_measured_ratio`), or, for a pair
        never compared, what the model predicts: a mode that lost clearly waits in proportion. A
        sparse path not yet warmed up gets one untimed step first."""
        assert self.incumbent is not None
        if self.step <= WARMUP_STEPS:  # dense steps this early are not timed
            return None
        incumbent_cost = costs[self.incumbent][0]
        rematch, self.rematch = self.rematch, None
        if rematch in costs and rematch != self.incumbent:
            self.trial = Trial(rematch, self.incumbent, [rematch, self.incumbent] * TRIAL_PAIRS)
            return self.trial
        for mode, (cost, _) in sorted(costs.items(), key=lambda item: item[1][0]):  # the likeliest winner first
            if mode == self.incumbent:
                continue
            tried = mode in self.last_trial
            since = self.step - self.last_trial.get(mode, 0)
            measured = self._measured_ratio(mode)
            extra_share = max(0.0, (measured - 1.0) if measured is not None else cost / incumbent_cost - 1.0)
            extra = TRIAL_PAIRS * extra_share / EXPLORE_SHARE
            if since >= max(MIN_REEXPLORE if tried else 0, extra):
                warm_up = [SPARSE] if mode == SPARSE and self.sparse_steps < EXPLORATION_STEPS - 1 else []
                self.trial = Trial(mode, self.incumbent, warm_up + [mode, self.incumbent] * TRIAL_PAIRS)
                return self.trial
        return None

    def _measured_ratio(self, challenger: str) -> float | None:
        """The `typical` ratio of ``challenger``'s steps to the incumbent's in their trials' pairs (None:
        never compared side by side)."""
        assert self.incumbent is not None
        history = self._ratios_over(challenger, self.incumbent)
        return typical(history) if history else None

    def _ratios_over(self, challenger: str, incumbent: str) -> deque[float]:
        """The pair's remembered step ratios (`pair_ratios`), as ``challenger``'s over ``incumbent``'s."""
        pair = tuple(sorted((challenger, incumbent)))
        return deque(r if pair[0] == challenger else 1 / r for r in self.pair_ratios.get(pair, ()))

    def _decide_trial(self, costs: dict[str, tuple[float, Plan]]) -> None:
        """Once a trial has run and its reports are in (or `TRIAL_PATIENCE` steps have passed), its
        pairs' ratios join the pair's earlier ones (`PAIR_WINDOW`), and the challenger becomes the
        incumbent if, with the margins, it was `CLEAR_WIN` times cheaper in every pair of this
        trial, or cheaper in the `typical` pair of at least two trials' worth: the first on a clear
        difference, the second on a close one that one trial's few steps cannot tell from the
        machine's noise. A first trial whose typical pair won but not clearly (or that one stalled
        step split) is run again at once (`rematch`), and the two decide, rather than one hiccup
        keeping the incumbent for `MIN_REEXPLORE` steps."""
        trial = self.trial
        if trial is None or trial.to_run or (trial.running and self.step - trial.last_step <= TRIAL_PATIENCE):
            return
        self.trial = None
        self.last_trial[trial.challenger] = self.last_trial[trial.incumbent] = self.step  # the pair was compared
        ratios = trial.ratios()
        pair = tuple(sorted((trial.challenger, trial.incumbent)))
        history = self.pair_ratios.setdefault(pair, deque(maxlen=PAIR_WINDOW))
        history.extend(r if pair[0] == trial.challenger else 1 / r for r in ratios)
        if not ratios or trial.incumbent != self.incumbent or trial.challenger not in costs:
            return
        threshold = win_threshold(trial.challenger, trial.incumbent)
        if (len(ratios) >= TRIAL_PAIRS and max(ratios) < threshold / CLEAR_WIN) or (
                len(history) >= 2 * TRIAL_PAIRS and typical(self._ratios_over(trial.challenger, trial.incumbent))
                < threshold):
            self.incumbent = trial.challenger
        elif len(history) < 2 * TRIAL_PAIRS and statistics.median(ratios) < threshold:
            self.rematch = trial.challenger  # a split first trial: a second at once, and both decide

    def energy_density(self, samples: list[torch.Tensor]) -> float:
        """The density at which the sampled gradient (``samples``, squared entries) sends the most of
        its energy per second of step (`sparsecomm.integration.gradient_energy`): the argmax over
        `DENSITY_CANDIDATES` densities d of E(min(1, H·d)) / (compute + O_s + per-byte cost · bytes(d)),
        from the agreed costs (so every rank weighs alike) and this rank's own gradient (0: not
        measurable yet). H is a horizon: with error feedback an entry left out is not lost but sent
        some steps later, and one sent within H steps moves the weights about as it would have on
        time, so a step's k entries carry about what the H·k largest of one step's gradient hold
        (H: the sparsifier's ``horizon``, or the feedback's `Feedback.delay_horizon`)."""
        if not samples or not self.compute_s or not self.throughput or self.budget_numel == 0:
            return 0.0
        squares = torch.cat(samples)
        low = self.sparsifier.floor
        densities = torch.logspace(math.log10(low), math.log10(max(low, MAX_SPARSE_DENSITY)), DENSITY_CANDIDATES,
                                   dtype=torch.float64)
        horizon = self.sparsifier.horizon or self.feedback_horizon
        energy = energy_share(squares, (densities * horizon).clamp(max=1.0))
        if not bool(energy[-1] > 0):
            return 0.0
        overhead = typical(self.sparse_overhead_s) if self.sparse_overhead_s else 0.0
        seconds = (statistics.median(self.compute_s) + overhead
                   + self.per_byte_s(statistics.median(self.throughput)) * self.step_bytes(densities))
        return float(densities[int((energy / seconds).argmax())])

    def dense_bytes(self) -> float:
        """An fp32 all_reduce of the whole gradient, in allgather bytes per rank."""
        return 2 / self.world_size * 4 * self.total_numel

    def step_budget(self) -> float | None:
        """Bytes the link and the codecs carry while the step computes (None: not measured yet), or
        the user-set budget: more than the whole gradient makes the step dense; before the gradient's
        energy is known, what a sparse step sends."""
        if self.sparsifier.budget:
            return float(self.sparsifier.budget)
        if not self.compute_s or not self.throughput:
            return None
        return statistics.median(self.compute_s) / self.per_byte_s(statistics.median(self.throughput))

    def per_byte_s(self, throughput: float) -> float:
        """Seconds a step spends per byte a rank sends: encoding it, and receiving and decoding the
        P−1 others' bytes."""
        peers = max(1, self.world_size - 1)
        return self.encode_per_byte + peers * (self.decode_per_byte + 1 / throughput)

    def step_bytes(self, density: Density) -> Density:
        """Bytes one rank sends on a sparse step at ``density`` (one, or a tensor of candidates)."""
        return self.fixed_bytes + density * self.budget_numel * self.bytes_per_nnz

    def _sparse(self, budget: float) -> Plan:
        density = (budget - self.fixed_bytes) / (self.bytes_per_nnz * self.budget_numel)
        return Plan(SPARSE, self.sparsifier.at_density(min(density, MAX_SPARSE_DENSITY)).density)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "total_numel": self.total_numel, "budget_numel": self.budget_numel,
                "compute_s": list(self.compute_s), "throughput": list(self.throughput),
                "half_throughput": list(self.half_throughput),
                "dense_cost_s": list(self.dense_cost_s), "half_cost_s": list(self.half_cost_s),
                "sparse_overhead_s": list(self.sparse_overhead_s),
                "preferred_density": list(self.preferred_density), "bytes_per_nnz": self.bytes_per_nnz,
                "fixed_bytes": self.fixed_bytes, "encode_per_byte": self.encode_per_byte,
                "decode_per_byte": self.decode_per_byte,
                "max_magnitude": self.max_magnitude,
                "last_compute_s": self.last_compute_s, "sparse_steps": self.sparse_steps,
                "reports_read": self.reports_read,
                "mode_steps": dict(self.mode_steps), "mode": self.current.mode, "incumbent": self.incumbent,
                "trial": self.trial.state_dict() if self.trial is not None else None,
                "last_trial": dict(self.last_trial), "rematch": self.rematch,
                "pair_ratios": [[*pair, list(ratios)] for pair, ratios in self.pair_ratios.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.total_numel, self.budget_numel = state["step"], state["total_numel"], state["budget_numel"]
        for name, size in (("compute_s", COMPUTE_WINDOW), ("throughput", THROUGHPUT_WINDOW),
                           ("dense_cost_s", COST_WINDOW), ("half_cost_s", COST_WINDOW),
                           ("sparse_overhead_s", COST_WINDOW)):
            setattr(self, name, deque(state[name], maxlen=size))
        self.half_throughput = deque(state.get("half_throughput", ()), maxlen=THROUGHPUT_WINDOW)
        self.preferred_density = deque(state.get("preferred_density", ()), maxlen=COMPUTE_WINDOW)
        self.bytes_per_nnz, self.fixed_bytes = state["bytes_per_nnz"], state["fixed_bytes"]
        self.encode_per_byte, self.decode_per_byte = state["encode_per_byte"], state["decode_per_byte"]
        self.max_magnitude, self.last_compute_s = state["max_magnitude"], state["last_compute_s"]
        self.sparse_steps, self.reports_read = state["sparse_steps"], state["reports_read"]
        self.mode_steps = dict(state.get("mode_steps", {}))
        self.current = Plan(state.get("mode", DENSE))  # the last step's mode: whether the next one switches
        self.incumbent = state.get("incumbent")
        self.trial = Trial.from_state(state["trial"]) if state.get("trial") is not None else None
        self.last_trial = dict(state.get("last_trial", {}))
        self.rematch = state.get("rematch")
        self.pair_ratios = {(first, second): deque(ratios, maxlen=PAIR_WINDOW)
                            for first, second, ratios in state.get("pair_ratios", [])}
        self.finished = None
