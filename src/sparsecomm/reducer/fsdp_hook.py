"""Compression under FSDP2 (``torch.distributed.fsdp.fully_shard``).

Over one flat group of every rank, each FSDP module's reduce-scatter sends each owner only the
largest entries of its range (`sparsecomm.reducer.sparse_reduce_scatter`). Hybrid, each node shards
the model over its own ranks (FSDP's dense reduce-scatter runs inside the node), and every shard is
averaged across nodes through a sparsecomm pipeline — in place of the all-reduce FSDP's native HSDP
would run over the slow link::

    mesh = topology.device_mesh("cuda")               # nodes × ranks per node
    for block in model.blocks:
        fully_shard(block, mesh=mesh["node"])
    fully_shard(model, mesh=mesh["node"])
    compression = sparsecomm.register_fsdp_hooks(model, "adaptive", mesh)

Each FSDP module's all-reduce hook (``FSDPModule.set_all_reduce_hook``) gets its reduce-scatter
output — this rank's shard, averaged over its node — and replaces it by the average over nodes
(`GradientReducer.reduce` over the ranks holding the same shard on every node, keyed by the
module's name: its error feedback holds this rank's shard, 1/``local_size`` of the module). FSDP
reduces only the parameters that require a gradient, so a shard's layout is read from them at
each call: a parameter frozen or unfrozen mid-run changes it. A step ends when every module holding
such a parameter has reported once (or one reports again).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sparsecomm.errors import SparseCommError
from sparsecomm.pipeline import Segment
from sparsecomm.presets import resolve
from sparsecomm.reducer.across_nodes import AcrossNodes, failed_in_node
from sparsecomm.reducer.checkpoint import check_owner
from sparsecomm.reducer.config import DENSE_BELOW
from sparsecomm.reducer.rank_state import CheckpointsPerRank
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.reducer.topology import ACROSS, NODE
from sparsecomm.spec import PipelineSpec, format_spec
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.collectives import fingerprint
from sparsecomm.transport.request import Request

if TYPE_CHECKING:  # FSDP2's hooks are imported where they are used: an older torch imports sparsecomm too
    from torch.distributed.fsdp import FSDPModule

    from sparsecomm.reducer.sparse_reduce_scatter import FlatFSDPCompression

FORMAT = 1
"""the format of `FSDPCompression.state_dict`"""


class FSDPCompression(AcrossNodes, CheckpointsPerRank):
    """The hooks `register_fsdp_hooks` set on every FSDP module of a model, and the reducer they
    share: its ``stats`` (what crossed between nodes), ``state_dict`` / ``load_state_dict`` (each
    rank's own) and ``close``.

    Example:
        ```python ranks=2
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        import sparsecomm as sc

        model = torch.nn.Linear(64, 64)
        mesh = sc.Topology(1).device_mesh("cpu")
        fully_shard(model, mesh=mesh["node"])
        compression = sc.register_fsdp_hooks(model, "dgc", mesh)
        model(torch.randn(4, 64)).sum().backward()
        torch.save(compression.state_dict(), f"compression-{dist.get_rank()}.pt")   # next to the model's
        compression.load_state_dict(torch.load(f"compression-{dist.get_rank()}.pt"))
        compression.close()
        ```
    """

    def __init__(self, model: nn.Module, modules: dict[str, tuple[FSDPModule, list[tuple[str, nn.Parameter]]]],
                 spec: str | PipelineSpec, mesh: DeviceMesh, seed: int = 0, nonfinite: str = "raise",
                 dense_below: int = DENSE_BELOW) -> None:
        if mesh.ndim != 2 or mesh.mesh_dim_names != (ACROSS, NODE):
            raise SparseCommError(f"a two-dimensional mesh must have dimensions {(ACROSS, NODE)} "
                                  f"(Topology.device_mesh), not {mesh.mesh_dim_names}")
        self.mesh = mesh
        # over the whole mesh: the hop between nodes checks its own ranks, never a node's two
        agree(None, Request(key="FSDPCompression settings"), mesh.size(),
              fingerprint(format_spec(resolve(spec)), seed, nonfinite, dense_below, tuple(mesh.shape),
                          sorted(name or "<root>" for name in modules)))
        self.across = GradientReducer(spec, group=mesh[ACROSS].get_group(), seed=seed, nonfinite=nonfinite,
                                      dense_below=dense_below, model=model)
        """averages each shard over the nodes (the model's forward starts ``adaptive``'s clock)"""
        self.modules = sorted(name or "<root>" for name in modules)
        self._parameters = {name or "<root>": parameters for name, (_, parameters) in modules.items()}
        self._reported: set[str] = set()
        self._expected: set[str] = set()
        """the modules holding a parameter that requires a gradient when the step began"""
        self._node_ranks = mesh[NODE].size()
        if self.across.adaptive is not None and self._node_ranks > 1:  # the node's shards share its link
            self.across.adaptive.plan_with(dist.new_subgroups_by_enumeration(mesh.mesh.tolist())[0])
        for name, (module, _) in modules.items():
            module.set_all_reduce_hook(self._hook_for(name or "<root>"))

    def _trainable(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters FSDP reduces: those that require a gradient, as they do now."""
        return [(key, parameter) for key, parameter in self._parameters[name] if parameter.requires_grad]

    def _hook_for(self, name: str) -> Any:
        layouts: dict[tuple[str, ...], tuple[str, tuple[Segment, ...]]] = {}
        """per set of parameters that require a gradient: the call's key and the shard's layout"""

        def average_over_nodes(shard: torch.Tensor) -> None:
            trainable = self._trainable(name)
            keys = tuple(key for key, _ in trainable)
            if keys not in layouts:  # the module's name, or with some parameters frozen, which ones are not
                every = len(self._parameters[name])
                key = name if len(keys) == every else \
                    f"{name} [{len(keys)} of {every} parameters, layout {zlib.crc32(chr(0).join(keys).encode()):08x}]"
                layouts[keys] = key, _segments(trainable, self._node_ranks, self.across.config.sends_whole)
            key, segments = layouts[keys]
            numel = sum(segment.numel for segment in segments)
            if shard.numel() != numel:
                raise SparseCommError(
                    f"FSDP module {name!r} reduced {shard.numel()} elements where the shards of its parameters that "
                    f"require a gradient hold {numel}: a parameter that requires one got none this step (a branch "
                    "not taken), which this hook cannot place; give it a gradient (add 0 * parameter.sum() to the "
                    "loss) or set requires_grad=False while it is unused")
            if name in self._reported:  # a step that did not reach every module: it ends here
                self.finish_step()
            if not self._reported:  # a step begins: the modules that will report in it
                self._expected = {other for other in self.modules if self._trainable(other)}
            averaged, error = shard, None
            try:
                averaged = self.across.reduce(key, shard, segments)
            except SparseCommError as err:
                error = err
            failed = error is not None
            if self._node_ranks > 1:  # a node's shards fail apart: its ranks raise together
                failed = failed_in_node(failed, self.mesh[NODE].get_group())
            if failed:
                raise error or SparseCommError(f"another rank of this node failed to reduce FSDP module {name!r} "
                                               "between nodes (its error says why)")
            shard.copy_(averaged)
            self._reported.add(name)
            if self._reported >= self._expected:
                self.finish_step()

        return average_over_nodes

    def finish_step(self) -> None:
        """End the step (the hooks call it once every module that reduces has reported; after
        that, a call ends nothing more)."""
        if not self._reported:
            return
        self._reported.clear()
        self.across.finish_step()

    def close(self) -> None:
        if self._reported:
            self.finish_step()
        self.across.close()

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (format `FORMAT`): each module's shard state across nodes, by module name."""
        return {"format": FORMAT, "mesh": list(self.mesh.shape), "modules": list(self.modules),
                "across": self.across.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned on this rank.

        Raises:
            SparseCommError: another format, mesh shape or set of FSDP modules.
        """
        check_owner(state, "FSDPCompression")
        if state.get("format") != FORMAT:
            raise SparseCommError(f"an FSDP compression checkpoint of format {state.get('format')!r}; this version "
                                  f"reads format {FORMAT}")
        if list(state["mesh"]) != list(self.mesh.shape) or list(state["modules"]) != self.modules:
            raise SparseCommError(f"the checkpoint is for a mesh of {tuple(state['mesh'])} over modules "
                                  f"{state['modules']}; this run has {tuple(self.mesh.shape)} over {self.modules}")
        self.across.load_state_dict(state["across"])


def _reducing_modules(model: nn.Module) -> dict[str, tuple[FSDPModule, list[tuple[str, nn.Parameter]]]]:
    """The FSDP modules that reduce gradients, with the parameters each holds (by name in
    ``model``, in FSDP's order): those holding a parameter no FSDP module inside them holds (an FSDP
    root over sharded blocks alone reduces nothing, and its hook is never called)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = {name: module for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    found = {}
    for name, module in fsdp.items():
        inner = {id(p) for child, other in fsdp.items() if child != name and (not name or child.startswith(f"{name}."))
                 for p in other.parameters()}  # type: ignore[attr-defined]  # an nn.Module too
        own = [(f"{name}.{key}" if name else key, p) for key, p in module.named_parameters()  # type: ignore[attr-defined]
               if id(p) not in inner]
        if own:
            found[name] = (module, own)
    return found


def _segments(parameters: list[tuple[str, nn.Parameter]], shards: int,
              sends_whole: Callable[[torch.Size], bool]) -> tuple[Segment, ...]:
    """Where each parameter's shard lies in its FSDP module's reduce-scatter output: FSDP pads each
    parameter's first dimension to a multiple of the shards and lays the shards end to end."""
    segments, start = [], 0
    for name, parameter in parameters:
        shape = parameter.shape if parameter.dim() else torch.Size([1])
        numel = -(-shape[0] // shards) * math.prod(shape[1:])
        segments.append(Segment(name, start, numel, sends_whole(parameter.shape)))
        start += numel
    return tuple(segments)


def register_fsdp_hooks(model: nn.Module, spec_or_preset: str | PipelineSpec, mesh: DeviceMesh | None = None,
                        seed: int = 0, nonfinite: str = "raise", dense_below: int = DENSE_BELOW
                        ) -> FSDPCompression | FlatFSDPCompression:
    """Compress FSDP2's gradient reduction. Call it on every rank after ``fully_shard`` on every
    module and the root, before the first backward.

    - Hybrid, ``mesh`` a nodes × ranks-per-node mesh (`Topology.device_mesh`), modules sharded on
      ``mesh["node"]``: FSDP reduce-scatters inside each node, and each shard is averaged across
      nodes through the pipeline.
    - Flat, ``mesh`` one-dimensional or None (modules sharded over every rank): each module's
      reduce-scatter sends each owner only the largest entries of its range
      (`sparsecomm.reducer.sparse_reduce_scatter`); the spec is ``topk(ratio=R)+residual+raw``
      with ``fp32``, ``fp16`` or ``bf16`` values.

    Args:
        model: the root module, after ``fully_shard``.
        spec_or_preset: a preset name (``"adaptive"``, ``"dgc"``) or a pipeline spec string.
        mesh: the mesh the modules are sharded over, as above.
        seed: as `GradientReducer`'s (hybrid).
        nonfinite: as `GradientReducer`'s (hybrid).
        dense_below: as `GradientReducer`'s (hybrid).

    Returns:
        Its ``stats``, and ``state_dict()`` / ``load_state_dict()`` for checkpoints (each rank's own).

    Raises:
        SparseCommError: the model holds no FSDP module, the mesh is not a topology's, the spec does
            not suit a flat group, or the ranks' arguments differ.

    Example:
        ```python ranks=2
        import torch
        from torch.distributed.fsdp import fully_shard

        import sparsecomm as sc

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
        mesh = sc.Topology(1).device_mesh("cpu")          # two nodes of one rank each
        for layer in model:
            fully_shard(layer, mesh=mesh["node"])
        fully_shard(model, mesh=mesh["node"])
        compression = sc.register_fsdp_hooks(model, "topk(ratio=0.1)+residual+rice+fp32", mesh)
        model(torch.randn(8, 64)).square().mean().backward()
        print(compression.stats.steps, "step,", compression.stats.bytes_sent, "bytes between nodes")
        ```
    """
    modules = _reducing_modules(model)
    if not modules:
        raise SparseCommError("the model holds no FSDP module: call fully_shard on its blocks and root first")
    if mesh is None or mesh.ndim == 1:
        from sparsecomm.reducer.sparse_reduce_scatter import FlatFSDPCompression

        return FlatFSDPCompression({name or "<root>": (module, [parameter for _, parameter in own])
                                    for name, (module, own) in modules.items()},
                                   resolve(spec_or_preset), mesh.get_group() if mesh is not None else None)
    return FSDPCompression(model, modules, spec_or_preset, mesh, seed, nonfinite, dense_below)
