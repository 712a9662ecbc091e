"""`GradientReducer`: averages gradients over a process group with one pipeline — the engine behind
the DDP hook (`ddp_comm_hook`) and custom loops (`GradientReducer.allreduce_`).

Each call — a named tensor, or a DDP bucket cut into its parameters (`BucketLayouts`) — takes one
`Route` (`route_of`): its path runs the local stages and posts the collective (`paths/`), and one
completion averages the sum, applies what the feedback owns and hands it back (`complete`);
`Runtime.submit` puts it on its way. The calls of a step go where `StepCalls` puts them; with the
``adaptive`` sparsifier an `AdaptiveController` plans every step. Rules every rank relies on:

- at construction all ranks check they have the same spec, seed, options and world size;
- every call's agreement step carries the stream's key and call number: ranks that pass different
  tensors, orders or counts get `SparseCommError` naming the key, never a sum of the wrong tensors;
- non-finite input follows ``nonfinite``; under ``"raise"`` every rank raises together, none is left
  waiting. So does every rank when one rank's codec refuses its values (beyond fp16's range).

The reducer owns all runtime state — the `Runtime` it builds on starting (its call counters,
per-parameter pipeline state, the plain and rows paths' state, auto's measurements, the adaptive
controller, the worker thread) — checkpoints it with ``state_dict()`` (format `FORMAT`) and
releases it with ``close()`` (or ``with``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.adaptive.controller import AdaptiveController
from sparsecomm.adaptive.density import share_density
from sparsecomm.errors import SparseCommError
from sparsecomm.pipeline import Pipeline, Segment
from sparsecomm.presets import resolve
from sparsecomm.reducer.buckets import unwrapped, warn_of_unused_parameters
from sparsecomm.reducer.checkpoint import FORMAT, migrate
from sparsecomm.reducer.config import DENSE_BELOW, ReducerConfig
from sparsecomm.reducer.named import agree_on_step, agree_on_suited, by_name, check_segments, problem, travels
from sparsecomm.reducer.optimizers import suited_once_begun
from sparsecomm.reducer.runtime import Runtime
from sparsecomm.reducer.stats import ReducerStats
from sparsecomm.spec import PipelineSpec, format_spec


class GradientReducer:
    """Averages gradients over ``group`` with the pipeline named by ``spec`` (a spec or a preset).

    The engine behind the DDP hook (`ddp_comm_hook`) and custom loops (`allreduce_`); its `Runtime`
    holds the state `state_dict` saves; ``stats`` counts what it sent. Build one on every rank, alike; built
    before torch.distributed is initialised (as under Lightning), it starts at its first call.

    Args:
        spec: a preset name (``"dgc"``), a pipeline spec string, or a parsed `PipelineSpec`.
        group: the process group (default: ``model``'s if it is a DDP model, else the world).
        seed: seeds every random choice; all ranks must pass the same.
        nonfinite: ``"raise"`` (every rank raises, none applies the sum), ``"propagate"`` (every rank's
            average NaN, as DDP's all_reduce makes it: a ``GradScaler`` skips the step), ``"skip"``
            (this rank sends nothing for that tensor this step) or ``"zero"`` (NaN/Inf become 0).
        dense_below: tensors (and DDP buckets) with fewer elements take the plain route; inside a
            compressed bucket, parameters that small are sent whole.
        average: divide the sum by the world size.
        model: the model whose parameters' names key the per-parameter state — the DDP model, the
            module it wraps, or any module holding the same parameter objects (a LightningModule);
            needed as a DDP hook state.

    Raises:
        SparseCommError: the ranks' arguments differ (when it starts), or an argument is invalid.
        SpecError: the spec is invalid.

    Example:
        ```python ranks=2
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import sparsecomm as sc

        ddp_model = DDP(torch.nn.Linear(128, 64))
        reducer = sc.GradientReducer("dgc", model=ddp_model)
        ddp_model.register_comm_hook(reducer, sc.ddp_comm_hook)
        ddp_model(torch.randn(4, 128)).sum().backward()
        print(reducer, reducer.stats.summary()["bytes_sent"])
        ```
    """

    def __init__(self, spec: str | PipelineSpec, group: dist.ProcessGroup | None = None, seed: int = 0,
                 nonfinite: str = "raise", dense_below: int = DENSE_BELOW, average: bool = True,
                 model: nn.Module | None = None) -> None:
        self.config = ReducerConfig(resolve(spec), seed, nonfinite, dense_below, average, world_size=0)
        """what every rank agrees on (its world size is 0 until the reducer starts)"""
        self.built_with = self.config.spec
        """the spec it was built with, which a call may name though `suit_optimizer` changed it"""
        self.group = group if group is not None else getattr(model, "process_group", None)
        # the module, not DDP's wrapper: DDP holds this reducer, and a reference back would keep both alive
        self._model = unwrapped(model)
        warn_of_unused_parameters(model, self.config.spec.feedback)
        self.stats = ReducerStats()
        self._loaded: dict[str, Any] | None = None
        """a checkpoint loaded before the reducer started, restored when it starts"""
        self.runtime: Runtime
        """its machinery, built when it starts"""
        if dist.is_initialized():
            self._running()

    @property
    def started(self) -> bool:
        """Whether the reducer has joined its process group: at construction, or at its first call."""
        return self.config.world_size > 0

    def _running(self) -> Runtime:
        """The runtime; at the first call (every rank there, torch.distributed initialised, perhaps by a
        trainer), join the group: agree on the configuration, build it, restore a checkpoint loaded before."""
        if self.started:
            return self.runtime
        if not dist.is_initialized():
            raise SparseCommError("torch.distributed is not initialised: call init_process_group first")
        self.config = replace(self.config, world_size=dist.get_world_size(self.group))
        self.runtime = Runtime(self.config, self.group, self._model, self.stats)
        if self._loaded is not None:  # kept, steps too, only once restored (another run's restores nothing)
            loaded, self._loaded, self.stats.steps = self._loaded, None, 0
            self.load_state_dict(loaded)
        return self.runtime

    def _begun(self) -> Runtime:
        """The runtime of a reducer that has started, else a clear refusal."""
        if not self.started:
            raise SparseCommError("this reducer has not started: torch.distributed was not initialised at its "
                                  "construction and it has reduced nothing yet (nor has it a state to save)")
        return self.runtime

    @property
    def pipeline(self) -> Pipeline:
        """Every parameter's pipeline state (residuals, momenta, step counts), by name."""
        return self._begun().pipeline

    @property
    def adaptive(self) -> AdaptiveController | None:
        """The ``adaptive`` sparsifier's controller (None for other pipelines)."""
        return self._begun().adaptive

    def suit_optimizer(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Before the first step, take a pipeline that suits ``optimizer`` (`suited_spec`: no momentum
        applied twice; ``adaptive``'s warm-up and floor); every rank calls it alike. Returns why the
        feedback changed, or None.

        Raises:
            SparseCommError: the feedback must change after the first step, or the ranks differ."""
        calls = self.runtime.counts if self.started else (self._loaded or {}).get("calls")  # a loaded run's too
        spec, why, refused = suited_once_begun(self.spec, optimizer, bool(calls))
        if self.started:  # every rank, changed or not, agrees on the pipeline it goes on with (else: at the start)
            agree_on_suited(self.group, spec, refused)
        if spec == self.spec:
            return None
        self.config = replace(self.config, spec=spec)
        if self.started:
            self.runtime.suit(self.config)
        return why

    @property
    def spec(self) -> PipelineSpec:
        return self.config.spec

    def __repr__(self) -> str:
        world = f"world_size={self.config.world_size}" if self.started else "not started"
        return f"GradientReducer({format_spec(self.spec)!r}, {world}, seed={self.config.seed})"

    def allreduce_(self, named_gradients: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One step of a custom loop: replace each gradient by its average over ranks (dense in
        place; sparse COO by ``copy_``). Tensors are matched across ranks by name — every rank must
        pass the same names, in any order, or every rank raises `SparseCommError`.

        Args:
            named_gradients: (name, gradient) pairs, dense or sparse COO (an embedding's); each
                name's state (residual, momentum) is kept under it.

        Raises:
            SparseCommError: a name repeats, a gradient is missing (None), not floating point or
                requires grad, the ranks pass different names or send one name dense and sparse,
                a gradient is non-finite under ``nonfinite="raise"``, or a codec cannot carry a
                rank's values — on every rank, whichever rank it was found on.

        Example:
            ```python ranks=2
            import torch

            import sparsecomm as sc

            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
            with sc.GradientReducer("topk(ratio=0.05)+residual+rice+fp32") as reducer:
                model(torch.randn(16, 64)).square().mean().backward()
                reducer.allreduce_((name, p.grad) for name, p in model.named_parameters())
            print(reducer.stats.summary()["compression_ratio"])
            ```
        """
        runtime = self._running()
        named = by_name(named_gradients)
        refused = problem(named)
        agree_on_step(self.group, named, self.stats.steps, len(named), 0 if refused else travels(named), refused)
        pending = [(tensor, runtime.submit(name, tensor, last=i == len(named) - 1))
                   for i, (name, tensor) in enumerate(named)]
        self.finish_step()
        for tensor, future in pending:
            averaged = future.wait()
            if averaged is not tensor:
                tensor.copy_(averaged)

    def reduce_bucket_async(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A future of DDP's ``bucket`` averaged over ranks, in DDP's layout, its parameters' state
        found by name (`ddp_comm_hook` calls it). Errors reach the future; `finish_step` raises the
        step's first."""
        runtime = self._running()
        layout = runtime.buckets.layout(bucket)
        reduced = runtime.submit(layout.key, layout.gathered(bucket), layout.segments, layout.stats_key,
                                 last=bucket.is_last() and layout.ddp_offsets is None)
        if layout.ddp_offsets is None:
            return reduced
        result = layout.to_ddp_later(reduced, bucket.buffer())  # reduced in the checkpoint's layout
        runtime.calls.in_flight[-1] = result  # the step waits for the copy back too
        return result

    def finish_step(self) -> None:
        """Wait for this step's calls, count the step, and raise the first error any call met
        (`ddp_comm_hook` calls it on the last bucket, `allreduce_` at its end).

        Raises:
            SparseCommError: the first error any of the step's calls met.
        """
        errors = self._begun().calls.finish()
        if self.adaptive is not None and self.adaptive.plan is not None:
            share_density(self.pipeline)
            self.adaptive.end_step(self.stats.steps)
        self.stats.steps += 1
        if errors:
            raise errors[0]

    def reduce(self, key: str, tensor: torch.Tensor, segments: tuple[Segment, ...] | None = None) -> torch.Tensor:
        """The average over ranks of ``tensor`` (same shape and kind), on this thread's return: never
        fused with a step's other calls (with the ``adaptive`` pipeline, it counts in the open step).

        Args:
            key: the stream's name; its state (residual, momentum) is kept under it.
            tensor: this rank's tensor, dense or sparse COO.
            segments: named tensors laid out in a flat ``tensor``, each keeping its state under its
                own name (as a DDP bucket's parameters do).

        Returns:
            The average over ranks, through the pipeline (lossy where its stages are).

        Raises:
            SparseCommError: the ranks disagree, or the tensor is non-finite under
                ``nonfinite="raise"`` — on every rank.

        Example:
            ```python ranks=2
            import torch
            import torch.distributed as dist

            import sparsecomm as sc

            with sc.GradientReducer("dense") as reducer:
                average = reducer.reduce("loss", torch.full((4,), float(dist.get_rank())))
            assert torch.equal(average, torch.full((4,), 0.5))
            ```
        """
        future = self.reduce_async(key, tensor, segments)
        self.runtime.calls.forget(future)
        return future.wait()

    def reduce_async(self, key: str, tensor: torch.Tensor,
                     segments: tuple[Segment, ...] | None = None) -> torch.futures.Future[torch.Tensor]:
        """`reduce` without waiting: a future of the average (errors reach it alone); `finish_step` waits for it."""
        return self._running().submit(key, tensor, segments, in_step=False)

    def reduce_flat_async(self, key: str, flat: torch.Tensor, segments: tuple[Segment, ...], stats_key: str = "",
                          last: bool = False) -> torch.futures.Future[torch.Tensor]:
        """A step's call on one flat buffer of named tensors at ``segments`` (each keeps its state by
        name), as a DDP bucket's: a future of its average; ``last``: the step's last call. A small
        call may wait to travel with the step's last, so its future completes at that call or at
        `finish_step`: wait on it after one of them.

        Raises:
            SparseCommError: the segments do not lay ``flat`` out (`check_segments`)."""
        check_segments(segments, flat.numel())
        return self._running().submit(key, flat, segments, stats_key, last)

    def close(self) -> None:
        """Wait for calls in flight, stop the worker thread, unhook the model (``with`` calls it)."""
        if self.started:
            self.runtime.close()

    def __enter__(self) -> GradientReducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit, by name (format `FORMAT`).

        Each rank's state is its own (residuals differ between ranks): every rank saves its own.

        Returns:
            A dict of tensors, numbers and strings for ``torch.save``.

        Example:
            ```python ranks=2
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            import sparsecomm as sc

            model = DDP(torch.nn.Linear(128, 64))
            reducer = sc.register_ddp_hook(model, "dgc")
            model(torch.randn(4, 128)).sum().backward()
            torch.save(reducer.state_dict(), f"reducer-{dist.get_rank()}.pt")

            resumed = sc.GradientReducer("dgc", model=model)    # in a fresh process, with a fresh DDP
            resumed.load_state_dict(torch.load(f"reducer-{dist.get_rank()}.pt"))
            assert resumed.stats.steps == 1
            ```
        """
        if not self.started and self._loaded is not None:
            return self._loaded
        return {"format": FORMAT, "steps": self.stats.steps, **self._begun().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint of any format this version reads (`migrate`).

        Args:
            state: what `state_dict` returned on this rank, for a reducer of the same spec and seed.

        Raises:
            SparseCommError: the checkpoint is for another spec or seed, world size, non-finite
                policy, ``dense_below`` or ``average``, or of a format this version cannot read;
                nothing is restored then. A reducer that has not started checks them when it
                starts, at its first call, and raises there.
        """
        state = migrate(state)
        if self.started:
            self.runtime.load_state_dict(state)
        else:
            self._loaded = state  # restored when the reducer starts
        self.stats.steps = state["steps"]
