"""One call of a reducer — a named gradient or a DDP bucket — and the `Route` it takes.

Routes, chosen once per call (`route_of`), each with its path object:

- ``plain``: an fp32 all_reduce of the tensor as it is, no pipeline — tensors sent whole that are
  smaller than ``dense_below`` or that the pipeline's codecs would carry exactly (indices and
  all), and every tensor of a pipeline whose transport is ``dense`` (`PlainPath`);
- ``compressed``: the pipeline's feedback, sparsifier and codecs, the spec's transport
  (`CompressedPath`);
- ``rows``: a sparse COO gradient's rows, all of them (`RowsPath`), unless the sparsifier
  selects from rows (`Sparsifier.selects_rows`): then it takes the route of the dense tensor it
  stands for, and its average goes back as rows;
- ``dense step``: a step the ``adaptive`` controller planned as fp32 or fp16 — every entry, each
  tensor's feedback flushed into it, one all_reduce as DDP's own hook posts it (`DenseStepPath`);
- ``device``: the compressed route of a pipeline whose every stage has a device form, and of an
  ``adaptive`` step planned on it (`Mode.DEVICE`) — one pass over the bucket in fixed sizes, one
  equal-size all_gather (`DevicePath`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.names import Name
from sparsecomm.pipeline import Segment
from sparsecomm.reducer.config import ReducerConfig
from sparsecomm.sparse_gradient import SparseGradient


class Route(Name):
    PLAIN = "plain"
    COMPRESSED = "compressed"
    ROWS = "rows"
    DENSE_STEP = "dense step"
    DEVICE = "device"
    LOW_RANK = "low rank"


@dataclass(frozen=True)
class Call:
    """One call: ``tensor``, the stream ``key`` (a tensor's name, or a bucket's), and for a flat
    buffer of several parameters their ``segments``. ``number`` counts the stream's calls (every
    rank must be at the same one); ``last``: the step's last call, run on the caller's thread;
    ``in_step``: the caller finishes the step (`GradientReducer.finish_step`); ``sparse_dim``: the
    caller's gradient was a sparse COO tensor of that many sparse dimensions (0: dense), whose
    average goes back in that kind."""

    key: str
    tensor: torch.Tensor
    segments: tuple[Segment, ...] | None = None
    stats_key: str = ""
    number: int = 0
    last: bool = False
    in_step: bool = True
    sparse_dim: int = 0

    @property
    def parameter(self) -> str:
        """The parameter the gradient belongs to: the bucket's only segment, or the call's key."""
        return self.segments[0].key if self.segments else self.key

    @property
    def flat(self) -> torch.Tensor:
        """The gradient as the pipeline takes it: a bucket flat, one tensor in its own shape."""
        return self.tensor.reshape(-1) if self.segments else self.tensor

    def density_spans(self) -> list[tuple[int, int]]:
        """(start, numel) of what a density covers: every segment not sent whole, or the tensor."""
        if self.segments:
            return [(s.start, s.numel) for s in self.segments if not s.whole]
        return [(0, self.tensor.numel())]


def route_of(tensor: torch.Tensor, segments: tuple[Segment, ...] | None, config: ReducerConfig,
             plan: Plan | None, takes_device_form: bool = False) -> Route:
    """The route a gradient (a bucket's: ``segments``) takes this step: ones the sparsifier sends
    whole take the plain route where the pipeline's codecs would not send them in fewer bytes;
    ``takes_device_form``: the compressed calls take the pipeline's device form
    (`ReducerConfig.gpus_take_device_form`)."""
    if tensor.is_sparse and not config.spec.sparsifier.selects_rows():
        return Route.ROWS
    if plan is not None and plan.dense:
        return Route.DENSE_STEP
    if plan is not None and plan.mode is Mode.LOW_RANK:
        return Route.LOW_RANK
    whole = all(s.whole for s in segments) if segments else config.sends_whole(tensor.shape)
    if config.spec.transport.name == "dense" or (whole and (tensor.numel() < config.dense_below
                                                             or config.codecs_exact)):
        return Route.PLAIN
    if config.on_device or takes_device_form or plan is not None and plan.mode is Mode.DEVICE:
        return Route.PLAIN if whole else Route.DEVICE  # every entry of a tensor sent whole goes cheapest as it is
    return Route.COMPRESSED


@dataclass
class Summed:
    """A path's sum over ranks, back on the gradient's device: ``total`` (flat or in the gradient's
    shape; ``owned``: a buffer the completion may change in place; ``averaged``: already divided by
    the world size), what the call sent and spent decoding, every rank's report numbers where
    the call carried this rank's (``sides``), and what the sum lost of this rank's contribution
    (``lost``, `Reduction.lost`)."""

    total: torch.Tensor
    bytes_sent: int
    decode_s: float = 0.0
    owned: bool = False
    averaged: bool = False
    carried_report: bool = False
    sides: torch.Tensor | None = None
    lost: SparseGradient | None = None
