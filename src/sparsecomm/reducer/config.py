"""`ReducerConfig`: what every rank's reducer must agree on — the pipeline, its seed, the non-finite
policy, the plain route's size bound, averaging and the world size — checked across ranks once,
when the reducer is built."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from sparsecomm.device.support import device_form, device_native
from sparsecomm.encode.base import codecs_lossless
from sparsecomm.encode.index.rle import RunLengthIndices
from sparsecomm.errors import SparseCommError
from sparsecomm.pipeline import NONFINITE_POLICIES
from sparsecomm.sparsify.adaptive import Adaptive
from sparsecomm.spec import PipelineSpec, format_spec
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.collectives import fingerprint
from sparsecomm.transport.request import Request

NONFINITE_SURFACED = (*NONFINITE_POLICIES, "propagate")
"""a reducer's non-finite policies: the pipeline's, and ``propagate`` — screened as ``raise``, every
rank's average of the call then NaN where it would raise (`ReducerConfig.screening`)"""
DENSE_BELOW = 4096
"""tensors (and DDP buckets) with fewer elements take the plain route: compressing them saves nothing"""


@dataclass(frozen=True)
class ReducerConfig:
    """A reducer's settings (see `GradientReducer`)."""

    spec: PipelineSpec
    seed: int = 0
    nonfinite: str = "raise"
    dense_below: int = DENSE_BELOW
    average: bool = True
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.nonfinite not in NONFINITE_SURFACED:
            raise SparseCommError(f"nonfinite must be one of {', '.join(NONFINITE_SURFACED)}")
        if self.dense_below < 0:
            raise SparseCommError("dense_below must be >= 0 elements")

    @property
    def screening(self) -> str:
        """How the paths treat a non-finite gradient (the pipeline's policy): as the reducer's
        ``nonfinite`` says, ``propagate`` as ``raise`` (`complete` then hands back NaN)."""
        return "raise" if self.nonfinite == "propagate" else self.nonfinite

    def sends_whole(self, shape: torch.Size) -> bool:
        """Whether a tensor of ``shape`` goes whole, not through the sparsifier (`Sparsifier.sends_whole`)."""
        return self.spec.sparsifier.sends_whole(shape, self.dense_below)

    @cached_property
    def codecs_exact(self) -> bool:
        """Whether the pipeline's codecs carry values exactly: then a tensor sent whole costs them its
        values' bytes and its indices', more than a plain fp32 all_reduce of it."""
        return codecs_lossless(self.spec.index_codec, self.spec.value_codec)

    @cached_property
    def on_device(self) -> bool:
        """Whether its compressed calls take the device route (`sparsecomm.device.support`)."""
        return device_native(self.spec) is None

    @cached_property
    def device_spec(self) -> PipelineSpec | None:
        """The pipeline the device route runs: the spec where it is device-native, else its device
        form (``adaptive``'s sparse steps may take it, `Mode.DEVICE`; another pipeline's calls take
        it on GPUs, `gpus_take_device_form`), else None."""
        return self.spec if self.on_device else device_form(self.spec)

    @cached_property
    def gpus_take_device_form(self) -> bool:
        """Whether the compressed calls take the device form where every rank's gradients are on a
        GPU: a pipeline with no ``adaptive`` planner to weigh the two routes, whose only stage
        without a device form is ``rle`` indices. On a GPU that codec costs a copy to the host and
        reads of the device per tensor, and sends more bytes than ``packed`` at DGC's densities;
        an entropy codec (``rice``, ``huffman``) sends fewer, and keeps the host path. On CPUs the
        codecs stay: there the device route was faster on digits and slower on lm."""
        return (not self.on_device and not isinstance(self.spec.sparsifier, Adaptive)
                and isinstance(self.spec.index_codec, RunLengthIndices) and self.device_spec is not None)

    def agree(self, group: dist.ProcessGroup | None) -> None:
        """Raise on every rank unless every rank of ``group`` has this configuration."""
        agree(group, Request(key="GradientReducer configuration"), self.world_size,
              fingerprint(format_spec(self.spec), self.seed, self.nonfinite, self.dense_below, self.average))

    def recorded(self) -> dict[str, int | str | bool]:
        """What a checkpoint records of this configuration beyond the pipeline's spec and seed:
        each rank's state (its residuals) is its own share of a run of this many ranks."""
        return {"world_size": self.world_size, "nonfinite": self.nonfinite, "dense_below": self.dense_below,
                "average": self.average}

    def check_recorded(self, saved: dict[str, int | str | bool] | None) -> None:
        """Raise unless a checkpoint's `recorded` configuration is this one (None: a checkpoint of a
        format that did not record it)."""
        if saved is None:
            return
        differs = {name: (saved.get(name), mine) for name, mine in self.recorded().items() if saved.get(name) != mine}
        if differs:
            said = ", ".join(f"{name} {then!r} (this reducer: {now!r})" for name, (then, now) in differs.items())
            raise SparseCommError(f"the checkpoint is of a reducer with {said}; each rank's state is its share of "
                                  "that run: resume with the same settings and ranks, or start a fresh reducer")

    def check_matches(self, other: ReducerConfig) -> None:
        """Raise unless ``other`` asks for this reducer's spec, seed, policy and size bound."""
        asked = (format_spec(other.spec), other.seed, other.nonfinite, other.dense_below)
        mine = (format_spec(self.spec), self.seed, self.nonfinite, self.dense_below)
        if asked != mine:
            raise SparseCommError(f"the state passed is a reducer for (spec, seed, nonfinite, dense_below) = {mine}, "
                                  f"but the call asks for {asked}; build a new reducer to change them")
