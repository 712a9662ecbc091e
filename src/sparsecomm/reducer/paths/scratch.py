"""`Scratch`: a path's reusable buffers, one per stream and kind, kept across steps so a step
allocates nothing. A buffer is taken while the call that wrote it is on the wire: a second call of
the same stream in that time (two ``reduce_async`` of one name in a step) gets a buffer of its own,
where reusing the first would overwrite what that call has yet to read."""

from __future__ import annotations

from collections.abc import Hashable

import torch


class Scratch:
    """Buffers by slot (a stream's name, with whatever else sets the buffer apart)."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, torch.Tensor] = {}
        self._taken: set[Hashable] = set()

    def take(self, slot: Hashable, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """An uninitialised buffer of ``shape``: the slot's own, unless a call still holds it."""
        if slot in self._taken:
            return torch.empty(shape, dtype=dtype, device=device)
        buffer = self._kept.get(slot)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype or buffer.device != device:
            buffer = self._kept[slot] = torch.empty(shape, dtype=dtype, device=device)
        self._taken.add(slot)
        return buffer

    def give_back(self, slot: Hashable, buffer: torch.Tensor) -> None:
        """The call that took ``buffer`` (or a view of it) has read it for the last time."""
        kept = self._kept.get(slot)
        if kept is not None and buffer.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr():
            self._taken.discard(slot)
