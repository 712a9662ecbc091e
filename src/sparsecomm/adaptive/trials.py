"""`Trials`: which mode the steps run in, changed only by side-by-side comparison.

Steps run in the *incumbent* mode, first the cheapest predicted. It changes only by a *trial*: a
challenger runs `AdaptiveConfig.trial_pairs` times, each step followed by one of the incumbent,
and wins if it was `clear_win` times cheaper than the incumbent's step after it in every pair of
the trial, or cheaper in the `typical` pair of the pair's last trials (at least two trials' worth)
— a less exact mode by its margin over a more exact one (`AdaptiveConfig.win_threshold`). A first
trial that won but not clearly, or was split by one stalled step, runs again at once. Steps of a
machine shared with others are slower for whole seconds at a time: modes measured at different
times would be ranked by the machine's mood, steps side by side are not.

A challenger's trial is due once its extra cost over its trial — as the pair's earlier trials
measured it, or as predicted for a pair never compared — is `explore_share` of the steps' time
since the pair was last compared, and never sooner than `min_reexplore` steps after (a mode never
compared: at once where the share allows). Of the modes due, the cheapest predicted goes first.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sparsecomm.adaptive.config import AdaptiveConfig, Mode, Plan
from sparsecomm.adaptive.measurement import typical

Predicted = dict[Mode, tuple[float, Plan]]
"""each allowed mode's predicted cost and the plan that runs it (`Costs.predicted`)"""


def pair_of(first: Mode, second: Mode) -> tuple[Mode, Mode]:
    """Two modes in `Mode`'s order (the more exact first): how a pair's ratios are kept."""
    order = list(Mode)
    return (first, second) if order.index(first) <= order.index(second) else (second, first)


@dataclass
class Trial:
    """A paired comparison of a ``challenger`` mode with the ``incumbent``: their steps alternate,
    and the two are judged by the ratios of adjacent steps (`ratios`)."""

    challenger: Mode
    incumbent: Mode
    to_run: list[Mode]
    """the modes of the trial's steps not yet run, in order"""
    running: dict[int, tuple[Mode, float]] = field(default_factory=dict)
    """step → (mode, density) of the trial's steps run and not yet reported"""
    costs: dict[int, tuple[Mode, float]] = field(default_factory=dict)
    """step → (mode, whole-step time) of the trial's steps reported"""
    last_step: int = 0

    def ratios(self) -> list[float]:
        """The challenger's step time over the incumbent's step right after it, for each such pair
        reported."""
        return [cost / self.costs[step + 1][1] for step, (mode, cost) in sorted(self.costs.items())
                if mode == self.challenger and step + 1 in self.costs and self.costs[step + 1][0] == self.incumbent]

    def state_dict(self) -> dict[str, Any]:
        return {"challenger": self.challenger.value, "incumbent": self.incumbent.value,
                "to_run": [mode.value for mode in self.to_run],
                "running": {step: [mode.value, density] for step, (mode, density) in self.running.items()},
                "costs": {step: [mode.value, cost] for step, (mode, cost) in self.costs.items()},
                "last_step": self.last_step}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Trial:
        return cls(Mode(state["challenger"]), Mode(state["incumbent"]), [Mode(mode) for mode in state["to_run"]],
                   {int(step): (Mode(run[0]), float(run[1])) for step, run in state["running"].items()},
                   {int(step): (Mode(cost[0]), float(cost[1])) for step, cost in state["costs"].items()},
                   state["last_step"])


@dataclass
class Trials:
    """The incumbent, the trial under way and what the pairs' trials measured (owned and
    checkpointed by a `Planner`)."""

    config: AdaptiveConfig
    incumbent: Mode | None = None
    """the mode steps run in outside trials (None: not chosen yet)"""
    trial: Trial | None = None
    last_trial: dict[Mode, int] = field(default_factory=dict)
    """the step each mode's last trial (as challenger or incumbent) was decided"""
    rematch: Mode | None = None
    """a challenger whose first trial was split (most pairs won, one lost): tried again at once"""
    pair_ratios: dict[tuple[Mode, Mode], deque[float]] = field(default_factory=dict)
    """per pair of modes (`pair_of`), the first's step time over the second's in their trials' pairs"""

    def choose(self, predicted: Predicted, step: int, runs: dict[Mode, int]) -> Plan:
        """This step's plan: the trial's next step, or the incumbent's."""
        self._decide(predicted, step)
        if self.incumbent not in predicted:  # the first choice, or fp16 no longer allowed: the cheapest
            self.incumbent = min(predicted, key=lambda mode: predicted[mode][0])
        trial = self.trial
        if trial is None:
            trial = self._due(predicted, step, runs)
        if trial is not None and trial.to_run:
            mode = trial.to_run.pop(0)
            if mode in predicted:
                plan = predicted[mode][1]
                trial.running[step] = (mode, plan.density)
                trial.last_step = step
                return plan
            self.trial = None  # its mode is no longer allowed
        return predicted[self.incumbent][1]

    def running(self, step: int) -> tuple[Mode, float] | None:
        """The mode and density of a trial's step whose report has not come in yet."""
        return self.trial.running.get(step) if self.trial is not None else None

    def reported(self, step: int, whole_s: float) -> None:
        """A trial's step took ``whole_s`` (0: not measured)."""
        assert self.trial is not None
        mode, _ = self.trial.running.pop(step)
        if whole_s > 0:
            self.trial.costs[step] = (mode, whole_s)

    def _due(self, predicted: Predicted, step: int, runs: dict[Mode, int]) -> Trial | None:
        """A trial of the cheapest predicted mode whose turn has come; a compressed mode (either
        sparse route, low rank) not yet warmed up (``runs``: the steps each mode has run) gets one
        untimed step first."""
        config = self.config
        assert self.incumbent is not None
        if step <= config.warmup_steps:  # dense steps this early are not timed
            return None
        incumbent_cost = predicted[self.incumbent][0]
        rematch, self.rematch = self.rematch, None
        if rematch in predicted and rematch != self.incumbent:
            self.trial = Trial(rematch, self.incumbent, [rematch, self.incumbent] * config.trial_pairs)
            return self.trial
        for mode, (cost, _) in sorted(predicted.items(), key=lambda item: item[1][0]):  # the likeliest winner first
            if mode == self.incumbent:
                continue
            since = step - self.last_trial.get(mode, 0)
            measured = self._measured_ratio(mode)
            extra_share = max(0.0, (measured - 1.0) if measured is not None else cost / incumbent_cost - 1.0)
            extra = config.trial_pairs * extra_share / config.explore_share
            if since >= max(config.min_reexplore if mode in self.last_trial else 0, extra):
                warm_up = [mode] if not mode.dense and runs.get(mode, 0) < config.exploration_steps - 1 else []
                self.trial = Trial(mode, self.incumbent, warm_up + [mode, self.incumbent] * config.trial_pairs)
                return self.trial
        return None

    def _measured_ratio(self, challenger: Mode) -> float | None:
        """The `typical` ratio of ``challenger``'s steps to the incumbent's in their trials' pairs
        (None: never compared side by side)."""
        assert self.incumbent is not None
        history = self._ratios_over(challenger, self.incumbent)
        return typical(history) if history else None

    def _ratios_over(self, challenger: Mode, incumbent: Mode) -> deque[float]:
        """The pair's remembered step ratios, as ``challenger``'s over ``incumbent``'s."""
        pair = pair_of(challenger, incumbent)
        return deque(r if pair[0] == challenger else 1 / r for r in self.pair_ratios.get(pair, ()))

    def _decide(self, predicted: Predicted, step: int) -> None:
        """Once a trial has run and its reports are in (or `trial_patience` steps have passed), its
        pairs' ratios join the pair's earlier ones, and the challenger becomes the incumbent if it
        won clearly in every pair of this trial, or in the `typical` pair of at least two trials'
        worth. A first trial whose typical pair won but not clearly is run again at once
        (`rematch`), and the two decide."""
        config, trial = self.config, self.trial
        if trial is None or trial.to_run or (trial.running and step - trial.last_step <= config.trial_patience):
            return
        self.trial = None
        self.last_trial[trial.challenger] = self.last_trial[trial.incumbent] = step  # the pair was compared
        ratios = trial.ratios()
        pair = pair_of(trial.challenger, trial.incumbent)
        history = self.pair_ratios.setdefault(pair, deque(maxlen=config.pair_window))
        history.extend(r if pair[0] == trial.challenger else 1 / r for r in ratios)
        if not ratios or trial.incumbent != self.incumbent or trial.challenger not in predicted:
            return
        threshold = config.win_threshold(trial.challenger, trial.incumbent)
        if (len(ratios) >= config.trial_pairs and max(ratios) < threshold / config.clear_win) or (
                len(history) >= 2 * config.trial_pairs
                and typical(self._ratios_over(trial.challenger, trial.incumbent)) < threshold):
            self.incumbent = trial.challenger
        elif len(history) < 2 * config.trial_pairs and statistics.median(ratios) < threshold:
            self.rematch = trial.challenger  # a split first trial: a second at once, and both decide

    def state_dict(self) -> dict[str, Any]:
        return {"incumbent": None if self.incumbent is None else self.incumbent.value,
                "trial": self.trial.state_dict() if self.trial is not None else None,
                "last_trial": {mode.value: step for mode, step in self.last_trial.items()},
                "rematch": None if self.rematch is None else self.rematch.value,
                "pair_ratios": [[first.value, second.value, list(ratios)]
                                for (first, second), ratios in self.pair_ratios.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.incumbent = None if state["incumbent"] is None else Mode(state["incumbent"])
        self.trial = Trial.from_state(state["trial"]) if state["trial"] is not None else None
        self.last_trial = {Mode(mode): step for mode, step in state["last_trial"].items()}
        self.rematch = None if state["rematch"] is None else Mode(state["rematch"])
        self.pair_ratios = {(Mode(first), Mode(second)): deque(ratios, maxlen=self.config.pair_window)
                            for first, second, ratios in state["pair_ratios"]}
