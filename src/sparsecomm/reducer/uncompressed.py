"""`UncompressedFeedback`: what the pipeline's feedback owns in place of the optimizer (DGC's
momentum), for tensors sent without it — plain and rows calls, and parameters a compressed or dense
step sends whole — applied to their average over ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sparsecomm.feedback.base import Feedback
from sparsecomm.pipeline import Segment


class UncompressedFeedback:
    """Per tensor sent uncompressed, the feedback's state (`Feedback.update_uncompressed`)."""

    def __init__(self, feedback: Feedback) -> None:
        self.feedback = feedback
        self.states: dict[str, dict[str, Any]] = {}

    def apply(self, total: torch.Tensor, key: str, segments: Sequence[Segment] | None,
              whole_only: bool) -> torch.Tensor:
        """``total`` (an average) after the feedback: of the whole call, or (``whole_only``) of the
        bucket's parameters sent whole."""
        if not self.feedback.applies_momentum:  # the feedback owns nothing the optimizer lacks
            return total
        if segments is None:
            return total if whole_only else self.feedback.update_uncompressed(total, self.states.setdefault(key, {}))
        flat = total.view(-1)
        chosen = [segment for segment in segments if segment.whole or not whole_only]
        if chosen:
            self.feedback.update_uncompressed_([flat[s.start:s.start + s.numel] for s in chosen],
                                               [self.states.setdefault(s.key, {}) for s in chosen])
        return total

    def state_dict(self) -> dict[str, Any]:
        return {key: {name: value.clone() for name, value in state.items()} for key, state in self.states.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.states = {key: {name: value.clone() for name, value in saved.items()} for key, saved in state.items()}
