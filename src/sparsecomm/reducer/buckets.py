"""DDP buckets as named parameters: `BucketLayouts` turns a ``GradBucket`` into the call that
reduces it — its key, its parameters' segments of the flat buffer — so state belongs to
parameters, not buffers. DDP's bucket rebuild after the first step, or a fresh DDP after a resume,
changes which parameters share a bucket, never whose state is whose.

A fresh DDP (as after a resume) runs its first step on its initial layout before rebuilding; a
dense all_reduce at 3+ ranks rounds each sum by position, so until DDP's layout matches the one in
the checkpoint again, the bucket is reduced in the checkpoint's layout (`BucketLayout.ddp_offsets`
says where each parameter goes back to).
"""

from __future__ import annotations

import inspect
import os
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.errors import SparseCommError
from sparsecomm.feedback.base import Feedback
from sparsecomm.feedback.none import NoFeedback
from sparsecomm.pipeline import Segment
from sparsecomm.reducer.completion import result_future


@dataclass(frozen=True)
class BucketLayout:
    """How one bucket is reduced: its stream key and stats key, its parameters' segments, and —
    when reduced in another layout than DDP's — each parameter's offset in DDP's buffer."""

    key: str
    stats_key: str
    segments: tuple[Segment, ...]
    ddp_offsets: tuple[tuple[str, int], ...] | None = None
    """(name, offset) of each parameter in DDP's buffer, in DDP's order (None: the layout is DDP's)"""

    def gathered(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The bucket's gradients in this layout (DDP's buffer itself when the layout is DDP's)."""
        if self.ddp_offsets is None:
            return bucket.buffer()
        gradients = dict(zip((name for name, _ in self.ddp_offsets), bucket.gradients(), strict=True))
        return torch.cat([gradients[segment.key].reshape(-1) for segment in self.segments])

    def to_ddp_later(self, reduced: torch.futures.Future, buffer: torch.Tensor) -> torch.futures.Future:
        """The future of ``reduced``'s sum in DDP's layout (``buffer`` is DDP's bucket)."""
        result = result_future(buffer)

        def to_ddp_layout(done: torch.futures.Future[torch.Tensor]) -> None:
            try:
                result.set_result(self.to_ddp(done.wait(), buffer))
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                result.set_exception(err)

        reduced.add_done_callback(to_ddp_layout)
        return result

    def to_ddp(self, total: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """A sum in this layout, in DDP's."""
        assert self.ddp_offsets is not None
        offsets = dict(self.ddp_offsets)
        in_ddp_layout = torch.empty_like(buffer)
        for segment in self.segments:
            offset = offsets[segment.key]
            in_ddp_layout[offset:offset + segment.numel] = total[segment.start:segment.start + segment.numel]
        return in_ddp_layout


def unwrapped(model: nn.Module | None) -> nn.Module | None:
    """The model a DDP wrapper trains (whose names its parameters' states go by), else ``model``."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def warn_of_unused_parameters(model: nn.Module | None, feedback: Feedback) -> None:
    """Warn where ``model`` is a DDP wrapper that finds unused parameters and ``feedback`` holds
    back what a step does not send: DDP writes no average into a parameter that no rank used in a
    step, so what its feedback sent then is lost."""
    if not getattr(model, "find_unused_parameters", False) or isinstance(feedback, NoFeedback):
        return
    package, frame, level = os.path.dirname(os.path.dirname(__file__)) + os.sep, inspect.currentframe(), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):  # the user's line, however reached
        frame, level = frame.f_back, level + 1
    warnings.warn("DDP(find_unused_parameters=True): a step's average is not written into a parameter no rank "
                  f"used in it, so what the {feedback.name!r} feedback sent for it then is lost; keep parameters "
                  "unused for whole phases out of the DDP model, or use 'none' feedback (docs: known-issues)",
                  stacklevel=level)


class BucketLayouts:
    """Per DDP bucket, its layout (a cache of what DDP's layout implies), and per set of parameters
    sharing a bucket, the order it was last reduced in (checkpointed)."""

    def __init__(self, model: nn.Module | None, sends_whole: Callable[[torch.Size], bool]) -> None:
        module = unwrapped(model)
        self._names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
        """parameter object → its name in the model"""
        self.shapes = {name: tuple(p.shape) for name, p in module.named_parameters()} if module is not None else {}
        """each parameter's shape by name"""
        self.sends_whole = sends_whole
        """whether a parameter of a shape goes whole (`ReducerConfig.sends_whole`)"""
        self.orders: dict[str, list[str]] = {}
        """per set of parameters sharing a bucket: the parameter order it was last reduced in"""
        self._restored: dict[str, list[str]] = {}
        """orders from a checkpoint that DDP has not yet come back to"""
        self._known: dict[tuple, BucketLayout] = {}
        """per bucket as DDP lays it out (index, buffer, parameters): worked out once"""

    def layout(self, bucket: dist.GradBucket) -> BucketLayout:
        """The bucket's layout: as it was last step while DDP keeps it, else worked out anew."""
        buffer = bucket.buffer()
        parameters = bucket.parameters()
        where = 0 if buffer.is_sparse else buffer.data_ptr()  # a sparse bucket is one parameter, no storage
        signature = (bucket.index(), where, buffer.numel(), buffer.is_sparse, tuple(map(id, parameters)))
        known = self._known.get(signature)
        if known is None:
            known = self._known[signature] = self._work_out(bucket, self._parameter_names(parameters))
            if known.ddp_offsets is not None:  # reduced in the checkpoint's layout: only this once
                del self._known[signature]
        return known

    def _parameter_names(self, parameters: list[torch.Tensor]) -> list[str]:
        if not self._names:
            raise SparseCommError("a GradientReducer used as a DDP hook state needs model= (its parameter names key "
                                  "each parameter's residual and momentum)")
        for parameter in parameters:
            if id(parameter) not in self._names:
                raise SparseCommError(f"a DDP bucket holds a parameter of shape {tuple(parameter.shape)} that is not "
                                      "in the model given to the GradientReducer")
        return [self._names[id(parameter)] for parameter in parameters]

    def _work_out(self, bucket: dist.GradBucket, names: list[str]) -> BucketLayout:
        buffer = bucket.buffer()
        order = self._reduction_order(names)
        layout = zlib.crc32("\0".join(order).encode())
        key = f"bucket {bucket.index()} [{order[0]} … {order[-1]}, {len(order)} parameters, layout {layout:08x}]"
        if buffer.is_sparse:
            return BucketLayout(key, names[0], (Segment(names[0], 0, buffer.numel()),))
        gradients = dict(zip(names, bucket.gradients(), strict=True))
        offsets = {name: (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
                   for name, grad in gradients.items()}
        stats_key = f"bucket{bucket.index()}"
        if order == names:
            return BucketLayout(key, stats_key, tuple(Segment(name, offsets[name], grad.numel(),
                                                              whole=self.sends_whole(grad.shape))
                                                      for name, grad in gradients.items()))
        segments, start = [], 0
        for name in order:
            numel = gradients[name].numel()
            segments.append(Segment(name, start, numel, whole=self.sends_whole(gradients[name].shape)))
            start += numel
        return BucketLayout(key, stats_key, tuple(segments), ddp_offsets=tuple(offsets.items()))

    def _reduction_order(self, names: list[str]) -> list[str]:
        """The order to reduce a bucket's parameters in: DDP's own, or the checkpoint's until DDP's
        layout matches it again."""
        members = f"{zlib.crc32(chr(0).join(sorted(names)).encode()):08x}"
        restored = self._restored.get(members)
        if restored is not None and restored != names:
            return restored
        self._restored.pop(members, None)
        self.orders[members] = names
        return names

    def state_dict(self) -> dict[str, Any]:
        return {key: list(names) for key, names in self.orders.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.orders = {key: list(names) for key, names in state.items()}
        self._restored = {key: list(names) for key, names in self.orders.items()}
        self._known = {}  # the checkpoint's orders decide the next bucket's
