"""FSDP2's reduce-scatter, compressed, over one flat group: SparCML's split phase on the device.

FSDP lays a module's unsharded gradient out as P equal ranges, range ``r`` the shard rank ``r``
keeps. `SparseReduceScatter` adds this rank's held-back error to it, picks the ``k`` entries of
largest magnitude in every range (a fixed ``k`` = ``ratio`` × range: fixed sizes, no host reads),
and sends each owner only its range's picks — indices in 32 bits, values in the spec's value
dtype — with one ``all_to_all_single`` each; the owner sums what it receives into its shard. What
was not sent, and what the values' rounding lost, stays in the error feedback: as large as the
module's unsharded gradient (in fp32 for a half-precision one), on every rank (FSDP itself holds that
only during the backward pass).
A non-finite entry is sent as it is (the optimizer or a gradient scaler sees it) and never kept;
a finite one beyond the value dtype's range (fp16's 65504) is sent at that bound, the rest held back.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # set_custom_reduce_scatter's type

from sparsecomm.encode.index.raw import RawIndices
from sparsecomm.encode.value.dtypes import cast_within
from sparsecomm.encode.value.floats import FloatValues
from sparsecomm.errors import SparseCommError
from sparsecomm.feedback.base import state_dtype
from sparsecomm.feedback.residual import Residual
from sparsecomm.reducer.checkpoint import check_owner
from sparsecomm.reducer.rank_state import CheckpointsPerRank
from sparsecomm.reducer.stats import ReducerStats, TensorStats
from sparsecomm.sparsify.topk import TopK
from sparsecomm.spec import PipelineSpec, format_spec
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.allgather import AllgatherTransport
from sparsecomm.transport.collectives import fingerprint
from sparsecomm.transport.request import Request

FORMAT = 2
"""the format of `FlatFSDPCompression.state_dict` (format 1 did not record the spec)"""


class SparseReduceScatter(ReduceScatter):
    """One FSDP module's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``), keeping the
    ``ratio`` of largest entries of each rank's range, values sent as ``values``; it counts into its
    own ``stats`` and the model's step count (``totals``: the calls of the module called most)."""

    def __init__(self, name: str, parameters: list[nn.Parameter], ratio: float, values: torch.dtype,
                 stats: TensorStats, totals: ReducerStats) -> None:
        self.name, self.parameters = name, parameters
        self.ratio, self.values, self.stats, self.totals = ratio, values, stats, totals
        self.residual: torch.Tensor | None = None
        """what this rank has held back, by range (the error feedback)"""
        self.reduced: tuple[bool, ...] | None = None
        """which of the module's parameters the residual's layout held at the last call (FSDP
        reduces those that require a gradient)"""
        self.loaded = False
        """whether the residual came from a checkpoint and no call has used it yet"""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise SparseCommError("a compressed reduce-scatter sums or averages, not another reduction (FSDP's "
                                  "gradient_divide_factor, which asks for one, is not supported)")
        ranks, numel = group.size(), output_tensor.numel()
        ranges = input_tensor.view(ranks, numel)
        dtype = state_dtype(ranges.dtype)  # a half-precision gradient's error is kept in fp32
        reduced = tuple(parameter.requires_grad for parameter in self.parameters)
        if self.loaded and self.residual is not None and self.residual.shape != ranges.shape:
            raise SparseCommError(f"the checkpoint's feedback of FSDP module {self.name!r} is laid out as "
                                  f"{tuple(self.residual.shape)} (ranks × range), this run's gradient as "
                                  f"{tuple(ranges.shape)}: resume with the same sharding and parameters")
        self.loaded = False
        if self.residual is None or self.residual.shape != ranges.shape or (
                self.reduced is not None and reduced != self.reduced):
            if self.residual is not None:
                warnings.warn(f"FSDP module {self.name!r} now reduces another set of its parameters (one frozen or "
                              "unfrozen): what it held back for the others is dropped", stacklevel=2)
            self.residual = torch.zeros_like(ranges, dtype=dtype)
        elif self.residual.device != ranges.device or self.residual.dtype != dtype:  # loaded elsewhere
            self.residual = self.residual.to(ranges.device, dtype)
        self.reduced = reduced  # (a residual from a checkpoint: taken as laid out as now)
        corrected = self.residual.add_(ranges)
        k = max(1, min(numel, round(self.ratio * numel)))
        picked = corrected.abs().topk(k, dim=1, sorted=False).indices
        values = corrected.gather(1, picked)
        sent = cast_within(values, self.values)
        corrected.scatter_(1, picked, values - sent.to(values.dtype))  # held back: all but what arrives
        corrected.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        indices = picked.to(torch.int32)
        received_indices, received = torch.empty_like(indices), torch.empty_like(sent)
        dist.all_to_all_single(received_indices, indices, group=group)
        dist.all_to_all_single(received, sent, group=group)
        output_tensor.zero_().index_add_(0, received_indices.view(-1).long(), received.view(-1).to(output_tensor.dtype))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(ranks)
        self.stats.steps += 1
        self.stats.bytes_sent += (ranks - 1) * k * (indices.element_size() + sent.element_size())
        self.stats.dense_bytes += (ranks - 1) * numel * input_tensor.element_size()  # a dense ring's share
        self.totals.steps = max(self.totals.steps, self.stats.steps)
        return None


class FlatFSDPCompression(CheckpointsPerRank):
    """A `SparseReduceScatter` on every FSDP module of a model that holds parameters, by module name:
    their ``stats`` and their error feedback (``state_dict``, each rank's own). Built by
    `register_fsdp_hooks` over a flat mesh.

    Example:
        ```python ranks=2
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import sparsecomm as sc

        model = torch.nn.Linear(256, 64)
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        compression = sc.register_fsdp_hooks(model, "topk(ratio=0.05)+residual+raw+bf16")
        model(torch.randn(4, 256)).sum().backward()
        torch.save(compression.state_dict(), f"feedback-{dist.get_rank()}.pt")   # next to the model's
        compression.load_state_dict(torch.load(f"feedback-{dist.get_rank()}.pt"))
        ```
    """

    def __init__(self, modules: dict[str, tuple[FSDPModule, list[nn.Parameter]]], spec: PipelineSpec,
                 group: dist.ProcessGroup | None = None) -> None:
        sparsifier, values = spec.sparsifier, spec.value_codec
        if not (isinstance(sparsifier, TopK) and sparsifier.ratio is not None and not sparsifier.warmup
                and isinstance(spec.feedback, Residual) and isinstance(values, FloatValues)
                and isinstance(spec.index_codec, RawIndices) and isinstance(spec.transport, AllgatherTransport)):
            raise SparseCommError("over one flat FSDP group the reduce-scatter takes topk(ratio=R)+residual+raw with "
                                  "fp32, fp16 or bf16 values (indices go as 32-bit integers, each owner's by "
                                  f"all_to_all, no other transport), not {format_spec(spec)!r}")
        self.spec = spec
        self.world_size = dist.get_world_size(group)
        layout = [(name, [tuple(parameter.shape) for parameter in parameters])
                  for name, (_, parameters) in sorted(modules.items())]
        agree(group, Request(key="FlatFSDPCompression configuration"), self.world_size,
              fingerprint(format_spec(spec), layout))  # else the ranks' exchanges differ in size: gloo aborts
        self.stats = ReducerStats()
        self.comms = {name: SparseReduceScatter(name, parameters, sparsifier.ratio, values.wire_dtype,
                                                self.stats.tensors.setdefault(name, TensorStats()), self.stats)
                      for name, (_, parameters) in modules.items()}
        for name, (module, _) in modules.items():
            module.set_custom_reduce_scatter(self.comms[name])

    adaptive = None
    """no ``adaptive`` controller: the flat reduce-scatter keeps a fixed ratio"""

    def suit_optimizer(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Nothing to suit: its residual feedback leaves momentum to the optimizer."""
        return None

    def finish_step(self) -> None:
        """Nothing to wait for: each module's reduce-scatter returns done, and counts the steps."""

    def close(self) -> None:
        """Nothing runs in the background."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's error feedback by FSDP module (format `FORMAT`)."""
        return {"format": FORMAT, "world_size": self.world_size, "spec": format_spec(self.spec),
                "steps": self.stats.steps,
                "residuals": {name: _copied(comm.residual) for name, comm in self.comms.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned on this rank.

        Raises:
            SparseCommError: another format, world size, spec or set of FSDP modules, or feedback laid
                out for another sharding (found where it is checked: at once where a module has
                reduced before, else at its next call).
        """
        check_owner(state, "FlatFSDPCompression")
        if state.get("format") not in (1, FORMAT) or state.get("world_size") != self.world_size:
            raise SparseCommError(f"the checkpoint is of format {state.get('format')!r} over "
                                  f"{state.get('world_size')} ranks; this run reads formats 1 to {FORMAT} over "
                                  f"{self.world_size}")
        if state.get("spec", format_spec(self.spec)) != format_spec(self.spec):
            raise SparseCommError(f"the checkpoint is of {state['spec']!r}; this run reduces with "
                                  f"{format_spec(self.spec)!r}")
        if set(state["residuals"]) != set(self.comms):
            raise SparseCommError(f"the checkpoint is over FSDP modules {sorted(state['residuals'])}; this model "
                                  f"has {sorted(self.comms)}")
        for name, residual in state["residuals"].items():
            now = self.comms[name].residual
            if residual is not None and now is not None and residual.shape != now.shape:
                raise SparseCommError(f"the checkpoint's feedback of FSDP module {name!r} is laid out as "
                                      f"{tuple(residual.shape)} (ranks × range), this run's as {tuple(now.shape)}: "
                                      "resume with the same sharding and parameters")
        for name, residual in state["residuals"].items():
            self.comms[name].residual, self.comms[name].loaded = _copied(residual), residual is not None
            self.stats.tensors[name].steps = state["steps"]  # each module's calls go on from there
        self.stats.steps = state["steps"]


def _copied(residual: torch.Tensor | None) -> torch.Tensor | None:
    """A residual handed out or taken in: the reduce-scatter updates its own in place."""
    return residual.detach().clone() if residual is not None else None
