"""`Tuning`: what ``auto`` has measured for one size class, and how it decides from the trials."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

CLOSE = 1.15
"""a runner-up whose median is within this factor of the leader's is a near-tie: both get more trials
(so is one whose trials overlap the leader's: see `Tuning`)"""
TIE_BREAK_TRIALS = 5
"""in a near-tie, the two finalists run up to this many times ``explore`` trials each"""
INDISTINGUISHABLE = 1.05
"""medians within this factor are noise apart (auto's trials run back to back, a training loop's
calls are interleaved with compute, which shifts them against each other): the model's ranking decides"""


@dataclass
class Tuning:
    """What auto has measured for one size class (the same on every rank).

    Every candidate runs ``trials`` times, interleaved. When the two best medians are within
    `CLOSE`, or the runner-up's faster quarter of trials reaches below the leader's slower quarter
    (their middle halves overlap: calls on a busy machine vary by more than their difference, and
    a few samples' medians can then come out in the wrong order), a handful of samples cannot
    order them: those two run on, interleaved, to `TIE_BREAK_TRIALS` × ``trials`` each. The lowest
    median wins, unless a candidate the model ranks higher (``candidates`` is in the model's
    order) is within `INDISTINGUISHABLE` of it."""

    candidates: list[str]
    seconds: dict[str, list[float]] = field(default_factory=dict)
    chosen: str | None = None
    finalists: list[str] | None = None

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def next_to_try(self, trials: int) -> str | None:
        pending = self._pending(trials)
        return min(pending, key=lambda c: len(self.seconds.get(c, []))) if pending else None

    def wants(self, name: str, trials: int) -> bool:
        """Whether a trial of ``name`` still counts (it is a candidate short of its trials)."""
        return self.chosen is None and name in self._pending(trials)

    def _pending(self, trials: int) -> list[str]:
        pool, target = ((self.candidates, trials) if self.finalists is None
                        else (self.finalists, TIE_BREAK_TRIALS * trials))
        return [c for c in pool if len(self.seconds.get(c, [])) < target]

    def record(self, name: str, seconds: float, trials: int) -> None:
        self.seconds.setdefault(name, []).append(seconds)
        if self.next_to_try(trials) is not None:
            return
        ranked = sorted(self.finalists or self.candidates, key=self.median)
        fastest = self.median(ranked[0])
        if self.finalists is None and len(ranked) > 1 and self._near_tie(ranked[0], ranked[1]):
            self.finalists = ranked[:2]
        else:
            self.chosen = next(c for c in self.candidates  # the model's order
                               if c in ranked and self.median(c) <= INDISTINGUISHABLE * fastest)

    def _near_tie(self, leader: str, runner_up: str) -> bool:
        """Whether ``leader``'s and ``runner_up``'s trials so far cannot tell which is faster."""
        slower_quarter = sorted(self.seconds[leader])[-1 - len(self.seconds[leader]) // 4]
        faster_quarter = sorted(self.seconds[runner_up])[len(self.seconds[runner_up]) // 4]
        return self.median(runner_up) <= CLOSE * self.median(leader) or faster_quarter <= slower_quarter

    def state_dict(self) -> dict[str, Any]:
        return {"candidates": list(self.candidates), "seconds": {k: list(v) for k, v in self.seconds.items()},
                "chosen": self.chosen, "finalists": None if self.finalists is None else list(self.finalists)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Tuning:
        return cls(list(state["candidates"]), {k: list(v) for k, v in state["seconds"].items()}, state["chosen"],
                   None if state["finalists"] is None else list(state["finalists"]))
