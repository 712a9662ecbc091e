"""`GradientReducer`: reduces named gradients over a process group with one pipeline — the engine
behind the DDP hook and `allreduce_gradients`.

Per tensor (or DDP bucket) it runs the pipeline locally (feedback → sparsify → encode), sums the
contributions with the pipeline's transport, and averages over the ranks. Rules:

- Dense tensors with fewer than ``dense_below`` elements (biases, norms, small last buckets) go
  through a plain fp32 all_reduce with no feedback: compressing them saves nothing.
- Sparse COO gradients (``nn.Embedding(sparse=True)``) are already sparse: all their rows are sent
  exactly (no sparsifier, no feedback) through the pipeline's transport, or ``allgather`` if that is
  ``dense``; the result is a sparse COO tensor again.
- Tensors sent these two uncompressed ways still get what the feedback owns in place of the
  optimizer: with ``dgc_momentum``, the same momentum, applied to their average over ranks.
- Non-finite input follows the pipeline's ``nonfinite`` policy; under ``"raise"`` every rank raises
  together (the flag rides on the transport's agreement step), none is left waiting.
- At construction all ranks check they have the same spec, seed, options and world size.

Asynchronous calls run their collectives on a process group of their own (created here, on every
rank), in submission order, so they never interleave with the caller's collectives.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.integration.presets import resolve
from sparsecomm.pipeline import Pipeline, screen_nonfinite
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.spec import PipelineSpec, format_spec
from sparsecomm.transport.allgather import AllgatherTransport
from sparsecomm.transport.base import ReduceContext, Transport
from sparsecomm.transport.collectives import agree, fingerprint
from sparsecomm.transport.dense import DenseTransport

DENSE_BELOW = 4096


@dataclass
class TensorStats:
    """Totals for one tensor or bucket since the reducer started (or was loaded)."""

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    select_s: float = 0.0
    transport_s: float = 0.0
    decode_s: float = 0.0
    path: str = ""

    @property
    def compression_ratio(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")


@dataclass
class ReducerStats:
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    steps: int = 0

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes_sent for t in self.tensors.values())

    @property
    def dense_bytes(self) -> int:
        return sum(t.dense_bytes for t in self.tensors.values())

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.steps, "bytes_sent": self.bytes_sent, "bytes_per_step": self.bytes_per_step,
            "compression_ratio": self.compression_ratio,
            "select_s": sum(t.select_s for t in self.tensors.values()),
            "transport_s": sum(t.transport_s for t in self.tensors.values()),
            "decode_s": sum(t.decode_s for t in self.tensors.values()),
        }


def nonzero_rows(dense: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """A coalesced sparse COO tensor of ``dense``'s nonzero slices over its first ``sparse_dim``
    dimensions — what ``dense.to_sparse(sparse_dim)`` returns, built from one mask pass and one
    gather (torch's conversion costs tens of µs per row on CPU)."""
    leading = dense.shape[:sparse_dim]
    flat = dense.reshape(math.prod(leading), -1)
    rows = (flat != 0).any(1).nonzero().squeeze(1)
    indices = torch.stack(torch.unravel_index(rows, leading)) if sparse_dim > 1 else rows[None]
    values = flat[rows].reshape((len(rows), *dense.shape[sparse_dim:]))
    return torch.sparse_coo_tensor(indices, values, dense.shape, is_coalesced=True, check_invariants=False)


class GradientReducer:
    """Averages gradients over ``group`` with the pipeline named by ``spec`` (a spec or a preset)."""

    def __init__(self, spec: str | PipelineSpec, group: dist.ProcessGroup | None = None, seed: int = 0,
                 nonfinite: str = "raise", dense_below: int = DENSE_BELOW, average: bool = True) -> None:
        if not dist.is_initialized():
            raise SparseCommError("torch.distributed is not initialised: call init_process_group first")
        self.spec = resolve(spec)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.seed, self.dense_below, self.average = seed, dense_below, average
        self.pipeline = Pipeline(self.spec, seed=seed, nonfinite=nonfinite, world_size=self.world_size)
        self.stats = ReducerStats()
        self._calls = 0
        self._uncompressed: dict[str, dict[str, Any]] = {}
        """per tensor sent uncompressed: the feedback's state for `Feedback.update_uncompressed`"""
        agree(group, self.world_size, fingerprint(format_spec(self.spec), seed, nonfinite, dense_below, average))
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self.async_group = dist.new_group(ranks=ranks)

    def __repr__(self) -> str:
        return f"GradientReducer({format_spec(self.spec)!r}, world_size={self.world_size}, seed={self.seed})"

    # -- reducing -----------------------------------------------------------------------------
    def reduce(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The average over ranks of ``tensor`` (same shape and kind), synchronously."""
        return self.reduce_async(key, tensor).wait()

    def reduce_async(self, key: str, tensor: torch.Tensor) -> torch.futures.Future:
        """Local stages now; the collective on a worker thread; a future of the average."""
        stats = self.stats.tensors.setdefault(key, TensorStats())
        stats.steps += 1
        stats.dense_bytes += tensor.numel() * 4
        start = time.perf_counter()
        transport, contribution, context = self._prepare(key, tensor, stats)
        path = stats.path
        stats.select_s += time.perf_counter() - start
        submitted = time.perf_counter()
        # the sum lands in the gradient's own storage: the local stages above already copied what they use
        out = tensor if not tensor.is_sparse and tensor.is_contiguous() and tensor.device.type == "cpu" else None
        future = transport.allreduce_async(contribution, self.async_group, context, out)

        result: torch.futures.Future = torch.futures.Future()

        def finish(done: torch.futures.Future) -> None:
            # not Future.then: it would wrap a SparseCommError in a RuntimeError
            try:
                total = done.wait()
                stats.transport_s += time.perf_counter() - submitted
                stats.decode_s += context.extra.get("decode_s", 0.0)
                stats.bytes_sent += context.bytes_sent
                if self.average:
                    total = total.div_(self.world_size) if out is not None and total is out else total / self.world_size
                if path != "compressed":
                    total = self.spec.feedback.update_uncompressed(total, self._uncompressed.setdefault(key, {}))
                if tensor.is_sparse:
                    result.set_result(nonzero_rows(total, tensor.sparse_dim()))
                else:
                    result.set_result(total.reshape(tensor.shape).to(tensor.dtype))
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                result.set_exception(err)

        future.add_done_callback(finish)
        return result

    def step_done(self) -> None:
        """Count one optimisation step (for bytes per step)."""
        self.stats.steps += 1

    def _prepare(self, key: str, tensor: torch.Tensor,
                 stats: TensorStats) -> tuple[Transport, SparseGradient | torch.Tensor, ReduceContext]:
        context = ReduceContext(index_codec=self.spec.index_codec, value_codec=self.spec.value_codec, seed=self.seed,
                                step=self._calls)
        self._calls += 1
        if tensor.is_sparse:
            stats.path = "sparse"
            transport = self.spec.transport if self.spec.transport.name != "dense" else AllgatherTransport()
            sparse = SparseGradient.from_sparse_coo(tensor.detach())
            values, context.nonfinite = screen_nonfinite(sparse.values, self.pipeline.nonfinite)
            if values is None:
                return transport, SparseGradient(sparse.indices[:0], sparse.values[:0], sparse.shape), context
            return transport, SparseGradient(sparse.indices, values, sparse.shape), context
        if tensor.numel() < self.dense_below or self.spec.transport.name == "dense":
            stats.path = "dense"
            screened, context.nonfinite = screen_nonfinite(tensor.detach(), self.pipeline.nonfinite)
            dense = screened if screened is not None else torch.zeros_like(tensor)
            transport = self.spec.transport if self.spec.transport.name == "dense" else DenseTransport()
            return transport, dense, context
        stats.path = "compressed"
        output = self.pipeline.step(tensor.reshape(-1), key)
        context.nonfinite = output.nonfinite
        context.payload = output.payload
        return self.spec.transport, output.selection, context

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline.state_dict(), "calls": self._calls, "steps": self.stats.steps,
                "uncompressed": {key: {name: value.clone() for name, value in state.items()}
                                 for key, state in self._uncompressed.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipeline.load_state_dict(state["pipeline"])
        self._calls = state["calls"]
        self.stats.steps = state["steps"]
        self._uncompressed = {key: {name: value.clone() for name, value in saved.items()}
                              for key, saved in state.get("uncompressed", {}).items()}
