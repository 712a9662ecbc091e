"""`RankState`: one rank's own state as ``torch.distributed.checkpoint`` keeps it.

DCP saves one copy of a key every rank writes (a replicated value); error feedback differs on every
rank. So each rank's state goes under its own key (``rank3``), as one blob that ``torch.load``
reads back with ``weights_only`` (tensors, numbers, strings): DCP loads what a template asks for,
and a fresh reducer's template cannot know the keys and shapes its state will have. A rank reads
back its own key: the checkpoint loads on the same ranks.
"""

from __future__ import annotations

import io
from typing import Any, Protocol

import torch
import torch.distributed as dist


class HasState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RankState:
    """``owner``'s state, for a DCP state dict (DCP calls `state_dict`, and `load_state_dict` on load)."""

    def __init__(self, owner: HasState) -> None:
        self.owner = owner

    def _key(self) -> str:
        return f"rank{dist.get_rank()}"

    def state_dict(self) -> dict[str, io.BytesIO]:
        blob = io.BytesIO()
        torch.save(self.owner.state_dict(), blob)
        blob.seek(0)
        return {self._key(): blob}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        blob = state[self._key()]
        blob.seek(0)
        self.owner.load_state_dict(torch.load(blob, weights_only=True))


class CheckpointsPerRank:
    """``for_checkpoint()``, for an owner of per-rank state (``state_dict`` / ``load_state_dict``)."""

    def for_checkpoint(self: HasState) -> RankState:
        """This rank's state for ``torch.distributed.checkpoint``: put it in the state dict that
        ``dcp.save`` and ``dcp.load`` take, next to the model's (`RankState`)."""
        return RankState(self)
