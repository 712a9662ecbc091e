"""`Runtime`: what a `GradientReducer` builds once it joins its process group — the pipeline, the
transport session, the DDP bucket layouts, its own process group, the ``adaptive`` controller, the
step's calls, every route's path and the calls counted per stream — and `Runtime.submit`, which
sends one call down its route. Rebuilt in part when the pipeline changes before the first step
(`suit`); its state goes into the reducer's checkpoint (`state_dict`)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.adaptive.controller import AdaptiveController
from sparsecomm.pipeline import Pipeline, Segment
from sparsecomm.reducer.buckets import BucketLayouts, unwrapped
from sparsecomm.reducer.call import Call, Route, route_of
from sparsecomm.reducer.completion import attach, result_future
from sparsecomm.reducer.config import ReducerConfig
from sparsecomm.reducer.paths.base import Parts, Path
from sparsecomm.reducer.paths.compressed import CompressedPath
from sparsecomm.reducer.paths.dense_step import DenseStepPath
from sparsecomm.reducer.paths.device import DevicePath
from sparsecomm.reducer.paths.low_rank import LowRankPath
from sparsecomm.reducer.paths.plain import PlainPath
from sparsecomm.reducer.paths.rows import RowsPath
from sparsecomm.reducer.stats import ReducerStats, TensorStats
from sparsecomm.reducer.step_calls import StepCalls
from sparsecomm.reducer.uncompressed import UncompressedFeedback
from sparsecomm.transport.collectives import on_wire, wire_device
from sparsecomm.transport.session import TransportSession


class Runtime:
    """A started reducer's machinery, over ``config`` (its world size known) on ``group``."""

    def __init__(self, config: ReducerConfig, group: dist.ProcessGroup | None, model: nn.Module | None,
                 stats: ReducerStats) -> None:
        self.config, self.group, self.stats = config, group, stats
        self.pipeline = Pipeline(config.spec, seed=config.seed, nonfinite=config.screening,
                                 world_size=config.world_size)
        self.session = TransportSession()
        self.buckets = BucketLayouts(model, config.sends_whole)
        config.agree(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(config.world_size))
        # over a part of the world, only its ranks make the group (each part makes its own at once)
        self.async_group = dist.new_group(ranks=ranks, use_local_synchronization=len(ranks) < dist.get_world_size())
        """the reducer's own group: its collectives never interleave with the caller's"""
        self.process_group = self.async_group if self.async_group is not None else _default_group()
        self.wire_device = wire_device(self.process_group)
        if config.world_size > 1:  # groups its calls need, made now with the others rather than in a step
            config.spec.transport.prepare(self.async_group, self.session)
        self.adaptive = AdaptiveController.of(config.spec, config.world_size, self.async_group, self.wire_device,
                                              unwrapped(model))
        """the adaptive sparsifier's controller (None for other pipelines)"""
        self.calls = StepCalls(self.async_group, self.session)
        self.counts: dict[str, int] = {}
        """per stream key: calls so far (the agreement step checks every rank is at the same call)"""
        self.takes_device_form: bool | None = None
        """whether the compressed calls take the pipeline's device form in place of its host codecs
        (`ReducerConfig.gpus_take_device_form`): decided at the first compressed call, alike on every
        rank (None: not yet)"""
        self._build_paths()

    def _build_paths(self) -> None:
        self.parts = Parts(self.config, self.pipeline, self.calls, UncompressedFeedback(self.config.spec.feedback),
                           self.stats, self.process_group, self.wire_device, dist.get_rank(self.process_group),
                           self.adaptive)
        paths: list[Path] = [PlainPath(self.parts), CompressedPath(self.parts), RowsPath(self.parts),
                             DenseStepPath(self.parts), DevicePath(self.parts),
                             LowRankPath(self.parts, self.buckets.shapes)]
        self.paths = {path.route: path for path in paths}

    def suit(self, config: ReducerConfig) -> None:
        """Take ``config``'s pipeline (before the first step; every rank alike, which it checks)."""
        config.agree(self.group)
        self.config = config
        self.takes_device_form = None
        self.pipeline = Pipeline(config.spec, seed=config.seed, nonfinite=config.screening,
                                 world_size=config.world_size)
        if self.adaptive is not None:
            self.adaptive.planner.suit(config.spec)
        self._build_paths()

    def submit(self, key: str, tensor: torch.Tensor, segments: tuple[Segment, ...] | None = None,
               stats_key: str = "", last: bool = False, in_step: bool = True) -> torch.futures.Future[torch.Tensor]:
        """One call (see `Call`): its route, its path's local stages and collective; a future of its
        average."""
        stats = self.stats.tensors.setdefault(stats_key or key, TensorStats())
        stats.steps += 1
        stats.dense_bytes += tensor.numel() * 4
        start = time.perf_counter()
        plan = self.adaptive.plan_call(start, tensor.device) if self.adaptive is not None else None
        route = route_of(tensor, segments, self.config, plan, bool(self.takes_device_form))
        if route is Route.COMPRESSED and self.takes_device_form is None:  # the same call on every rank
            self.takes_device_form = self.config.gpus_take_device_form and self._all_on_gpus(tensor)
            route = route_of(tensor, segments, self.config, plan, self.takes_device_form)
        if route is Route.COMPRESSED and segments is None and self.config.sends_whole(tensor.shape):
            segments = (Segment(key, 0, tensor.numel(), whole=True),)  # a large vector under DGC's rule
        sparse_dim = tensor.sparse_dim() if tensor.is_sparse else 0
        if sparse_dim and route is not Route.ROWS:  # a sparsifier that selects from rows takes them dense
            tensor = tensor.to_dense()
        if not in_step and not tensor.is_sparse:  # `reduce`: the average is a tensor of its own, the caller's stays
            tensor = tensor.detach().clone()
        number = self.counts.get(key, 0)
        self.counts[key] = number + 1
        call = Call(key, tensor, segments, stats_key, number, last, in_step, sparse_dim)
        path = self.paths[route]
        try:
            pending = path.post(call, plan, start)
        except Exception as err:  # noqa: BLE001 - the call fails as a collective's would: the step still ends
            failed = result_future(call.tensor)
            failed.set_exception(err)
            self.calls.track(failed, in_step)
            return failed
        stats.route = route.value
        stats.select_s += pending.submitted - start
        return attach(self.parts, call, path, pending, stats)

    def _all_on_gpus(self, tensor: torch.Tensor) -> bool:
        """Whether every rank's gradient is on a GPU (one all_reduce)."""
        here = on_gpu(tensor)
        if self.config.world_size == 1:
            return here
        self.calls.in_order()
        flag = on_wire(torch.tensor([float(here)]), self.wire_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
        return bool(flag.item() > 0)

    def close(self) -> None:
        if self.adaptive is not None:
            self.adaptive.close()
        self.session.close()
        self.calls.abandon("the reducer was closed before the step's calls finished (finish_step() ends a step)")

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.parts.config.recorded(), "calls": dict(self.counts),
                "pipeline": self.pipeline.state_dict(), "uncompressed": self.parts.uncompressed.state_dict(),
                "session": self.session.state_dict(), "bucket_orders": self.buckets.state_dict(),
                "row_errors": self.paths[Route.ROWS].state_dict(),
                "adaptive": self.adaptive.state_dict() if self.adaptive is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint (in this version's format): nothing changes unless it is for this
        pipeline's spec and seed, and this reducer's world size and settings."""
        self.pipeline.check_state(state["pipeline"])
        self.parts.config.check_recorded(state["config"])
        self.counts = dict(state["calls"])
        self.pipeline.load_state_dict(state["pipeline"])
        self.parts.uncompressed.load_state_dict(state["uncompressed"])
        self.session.load_state_dict(state["session"])
        self.paths[Route.ROWS].load_state_dict(state["row_errors"])
        self.buckets.load_state_dict(state["bucket_orders"])
        if self.adaptive is not None and state["adaptive"] is not None:
            self.adaptive.load_state_dict(state["adaptive"])


def on_gpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is in a CUDA GPU's memory."""
    return tensor.is_cuda


def _default_group() -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group()
