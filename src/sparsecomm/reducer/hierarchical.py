"""`HierarchicalReducer`: averages gradients over nodes of several ranks in three hops, so that only
the slow link between nodes carries compressed traffic, and only once per node:

1. inside each node, a dense reduce-scatter sums the buffer onto its ranks, each owning a shard
   (`NodeShards`: slice ``l`` of every tensor belongs to local rank ``l``) — a sparse gradient (an
   embedding's rows) is summed by an all-gather of the rows instead, and split by row
   (`sparsecomm.reducer.node_rows`);
2. each rank reduces its shard with the ranks that own it on the other nodes, through the
   compressed pipeline (a `GradientReducer` over those ranks: its error feedback holds
   1/``local_size`` of the model, its ``adaptive`` budgets the link between nodes);
3. inside each node, an all-gather puts the averaged shards (or rows) back together.

A node of one rank (``Topology(1)``) is a flat group: the shard is the whole buffer and no node hop
runs. Node hops are issued on the caller's thread in call order, so every node's ranks meet in the
same collectives: a reduce-scatter starts without waiting and its shard goes on between nodes once
it has landed (`NodeScatters`), while the backward pass computes; the all-gathers start at the
step's end (`finish_step`), each as its shard's average arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.errors import SparseCommError
from sparsecomm.pipeline import Segment
from sparsecomm.presets import resolve
from sparsecomm.reducer import node_rows
from sparsecomm.reducer.across_nodes import AcrossNodes, failed_in_node
from sparsecomm.reducer.buckets import BucketLayouts
from sparsecomm.reducer.checkpoint import check_owner
from sparsecomm.reducer.completion import result_future
from sparsecomm.reducer.config import DENSE_BELOW
from sparsecomm.reducer.named import agree_on_step, by_name, problem, travels
from sparsecomm.reducer.node_scatters import NodeScatters
from sparsecomm.reducer.node_shards import NodeShards
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.reducer.topology import NodeGroups, Topology, node_twin
from sparsecomm.spec import PipelineSpec, format_spec
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.collectives import all_gather_single, fingerprint, reduce_scatter_single
from sparsecomm.transport.request import Request
from sparsecomm.transport.waiting import wait_for

FORMAT = 1
"""the format of `HierarchicalReducer.state_dict`"""


@dataclass
class _Shard:
    """One call between its reduce-scatter and its all-gather."""

    shards: NodeShards | None
    """how the node splits the buffer (None: a node of one rank, or rows)"""
    buffer: torch.Tensor
    """this rank's shard, summed over its node (padded to the shard size; rows: the gradient)"""
    result: torch.futures.Future
    """the call's future (the average in the caller's layout)"""
    finish: Callable[[torch.Tensor], torch.Tensor]
    """the averaged buffer in the caller's layout"""
    rows: bool = False
    """a sparse gradient, split among the node's ranks by row"""
    across: torch.futures.Future[torch.Tensor] | None = None
    """its average over nodes, once posted"""


class HierarchicalReducer(AcrossNodes):
    """Averages gradients over ``group``'s ranks laid out on nodes (``topology``): dense inside each
    node, through the pipeline named by ``spec`` between nodes. Used as `GradientReducer` is — a DDP
    hook state (`ddp_comm_hook`, or `register_ddp_hook` with ``topology=``) or `allreduce_` in a
    custom loop — and built on every rank with the same arguments, after torch.distributed starts.

    Args:
        spec: a preset name, a pipeline spec string, or a parsed `PipelineSpec`.
        topology: ranks per node (default: torchrun's, `Topology.from_env`).
        group: the process group (default: ``model``'s if it is a DDP model, else the world).
        seed: as `GradientReducer`'s, for the hop between nodes.
        nonfinite: as `GradientReducer`'s, for the hop between nodes.
        dense_below: as `GradientReducer`'s, for the hop between nodes.
        average: as `GradientReducer`'s, for the hop between nodes.
        model: the model whose parameter names key each parameter's state (needed as a DDP hook state).

    Raises:
        SparseCommError: torch.distributed is not initialised, the world does not fill the nodes, or
            the ranks' arguments or topologies differ.

    Example:
        ```python ranks=2
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import sparsecomm as sc

        model = DDP(torch.nn.Linear(128, 64))
        reducer = sc.register_ddp_hook(model, "topk(ratio=0.05)+residual+rice+fp32", topology=sc.Topology(2))
        model(torch.randn(4, 128)).sum().backward()
        print(reducer.groups.nodes, "node:", reducer.stats.summary()["bytes_sent"], "bytes between nodes")
        ```
    """

    def __init__(self, spec: str | PipelineSpec, topology: Topology | None = None,
                 group: dist.ProcessGroup | None = None, seed: int = 0, nonfinite: str = "raise",
                 dense_below: int = DENSE_BELOW, average: bool = True, model: nn.Module | None = None) -> None:
        if not dist.is_initialized():
            raise SparseCommError("torch.distributed is not initialised: call init_process_group first")
        topology = topology if topology is not None else Topology.from_env()
        if group is None and model is not None:
            group = getattr(model, "process_group", None)
        self.group = group
        settings = fingerprint(format_spec(resolve(spec)), seed, nonfinite, dense_below, average)
        # over the whole group: the hop between nodes checks its own ranks, never a node's two
        agree(group, Request(key="HierarchicalReducer topology and settings"), topology.local_size, settings)
        self.groups = NodeGroups.make(topology, group)
        self.across = GradientReducer(spec, group=self.groups.cross_group, seed=seed, nonfinite=nonfinite,
                                      dense_below=dense_below, average=average, model=model)
        """the compressed hop: this rank with the ranks owning the same shard on the other nodes"""
        if self.across.adaptive is not None and topology.local_size > 1:  # the node's shards share its link
            self.across.adaptive.plan_with(node_twin(topology, group))
        self.average = average
        self.buckets = BucketLayouts(model, self.across.config.sends_whole)
        self.node_bytes = 0
        """bytes this rank sent to its node's ranks (reduce-scatter and all-gather, ring-counted)"""
        self._shards: dict[tuple[str, int], NodeShards] = {}
        self._open: list[_Shard] = []
        self._scatters = NodeScatters()

    def __repr__(self) -> str:
        nodes, local_size = self.groups.nodes, self.groups.topology.local_size
        return f"HierarchicalReducer({self.across!r} across {nodes} nodes × {local_size} ranks)"

    # -- one step ---------------------------------------------------------------------------------
    def reduce_bucket_async(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A future of DDP's ``bucket`` averaged over ranks (`ddp_comm_hook` calls it); it completes at
        the step's end (`finish_step`)."""
        layout = self.buckets.layout(bucket)
        buffer = bucket.buffer()
        if buffer.is_sparse:  # an embedding's rows: one parameter, in DDP's layout
            return self._post_rows(layout.key, buffer, layout.segments, layout.stats_key, bucket.is_last())

        def in_ddp_layout(total: torch.Tensor) -> torch.Tensor:
            return total if layout.ddp_offsets is None else layout.to_ddp(total, buffer)

        return self._post(layout.key, layout.gathered(bucket), layout.segments, layout.stats_key,
                          bucket.is_last(), in_ddp_layout)

    def allreduce_(self, named_gradients: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One step of a custom loop: replace each gradient by its average over ranks, in place
        (sparse COO by ``copy_``). The dense gradients travel as one buffer (sorted by name), each
        keeping its state by name; each sparse one (an embedding's) travels by its rows.

        Raises:
            SparseCommError: a name repeats, the ranks pass different names or shapes, a dense
                gradient is of another dtype or device than the first, or a gradient is non-finite
                under ``nonfinite="raise"`` — on every rank.
        """
        named = by_name(named_gradients)
        if not named:
            raise SparseCommError("allreduce_ needs at least one gradient")
        refused = problem(named)
        dense = [(name, tensor) for name, tensor in named if not tensor.is_sparse] if not refused else []
        rows = [(name, tensor) for name, tensor in named if tensor.is_sparse] if not refused else []
        for name, tensor in dense:
            first = dense[0][1]
            if not refused and (tensor.dtype != first.dtype or tensor.device != first.device):
                refused = (f"{name}: a HierarchicalReducer reduces dense gradients of one dtype and device "
                           f"({first.dtype} on {first.device}), not {tensor.dtype} on {tensor.device}")
        segments, start = [], 0
        for name, tensor in dense:
            segments.append(Segment(name, start, tensor.numel(), self.across.config.sends_whole(tensor.shape)))
            start += tensor.numel()
        key = 0 if refused else fingerprint(*((name, tuple(tensor.shape), tensor.is_sparse) for name, tensor in named))
        agree_on_step(self.group, named, self.stats.steps, start,
                      0 if refused else fingerprint(key, travels(named, dtypes=True)), refused)
        pending = [(tensor, self._post_rows(name, tensor, (Segment(name, 0, tensor.numel()),), name,
                                            last=not dense and i == len(rows) - 1))
                   for i, (name, tensor) in enumerate(rows)]
        flat = torch.cat([tensor.reshape(-1) for _, tensor in dense]) if dense else None
        buffer = None if flat is None else self._post(f"gradients {key:08x}", flat, tuple(segments), "gradients",
                                                      True, lambda total: total)
        self.finish_step()
        for tensor, future in pending:
            tensor.copy_(future.wait())
        if buffer is not None:
            averaged = buffer.wait()
            for segment, (_, tensor) in zip(segments, dense, strict=True):
                tensor.copy_(averaged[segment.start:segment.start + segment.numel].view_as(tensor))

    def _post(self, key: str, flat: torch.Tensor, segments: tuple[Segment, ...], stats_key: str, last: bool,
              finish: Callable[[torch.Tensor], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        """Start reduce-scattering ``flat`` inside the node, and post this rank's shard across nodes
        once it has landed (the step's last call: now)."""
        local_size, local_rank = self.groups.topology.local_size, self.groups.local_rank
        flat = self._screened(flat)
        shards: NodeShards | None = None
        work, source = None, flat
        if local_size == 1:  # the shard is the whole buffer
            buffer, owned, mine = flat, flat, segments
        else:
            shards = self._shards.get((key, flat.numel()))
            if shards is None:
                shards = self._shards[key, flat.numel()] = NodeShards.of(segments, flat.numel(), local_size,
                                                                         flat.device)
            buffer, source = flat.new_empty(shards.shard_numel), shards.to_shards(flat)
            work = reduce_scatter_single(buffer, source, group=self.groups.node_group, async_op=True)
            self.node_bytes += (local_size - 1) * shards.shard_numel * flat.element_size()
            owned, mine = buffer[:shards.owned_numel(local_rank)], shards.owned[local_rank]
        call = _Shard(shards, buffer, result_future(flat), finish)
        self._open.append(call)

        def post() -> None:
            call.across = self.across.reduce_flat_async(key, owned, mine, stats_key, last)

        self._scatters.add(work, (buffer, source), post)
        self._scatters.post_landed(wait=last)
        return call.result

    def _post_rows(self, key: str, grad: torch.Tensor, segments: tuple[Segment, ...], stats_key: str,
                   last: bool) -> torch.futures.Future[torch.Tensor]:
        """Sum a sparse ``grad`` inside the node now (an all-gather of its rows), and post the rows
        this rank owns across nodes."""
        local_size = self.groups.topology.local_size
        mine = grad.coalesce()
        if self.across.config.screening != "raise":
            mine = torch.sparse_coo_tensor(mine.indices(), self._screened(mine.values()), mine.shape).coalesce()
        self._scatters.post_landed(wait=True)  # the hop between nodes takes calls in call order
        if local_size > 1:
            total, sent = node_rows.summed(mine, self.groups.node_group)
            self.node_bytes += sent
            mine = node_rows.owned(total, local_size, self.groups.local_rank)
        call = _Shard(None, grad, result_future(grad), lambda total: total, rows=True)
        call.across = self.across.reduce_flat_async(key, mine, segments, stats_key, last)
        self._open.append(call)
        return call.result

    def _screened(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's own gradient before its node sums it, under ``nonfinite="zero"`` or ``"skip"``
        (no host read): its NaN and Inf entries zero, or all of it where any is, so the node's sum
        holds every other rank's gradient, as a flat group's does. Under ``"raise"`` it goes as it
        is, and the sum's check between nodes raises on every rank."""
        policy = self.across.config.screening
        if policy == "zero" and values.is_floating_point():
            return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        if policy == "skip" and values.is_floating_point():
            return values.masked_fill(~torch.isfinite(values).all(), 0.0)
        return values

    def finish_step(self) -> None:
        """Wait for the step's calls across nodes, put each call's shards back together inside the
        node (in call order, on every rank), and complete their futures.

        Raises:
            SparseCommError: the first error any call met — on every rank.
        """
        open_calls, self._open = self._open, []
        error: Exception | None = None
        try:
            self._scatters.post_landed(wait=True)
            self.across.finish_step()
        except Exception as err:  # noqa: BLE001 - every rank of the node raises it, below
            self._scatters.drop()
            error = err
        local_size = self.groups.topology.local_size
        if local_size > 1 and failed_in_node(error is not None, self.groups.node_group) and error is None:
            error = SparseCommError("another rank of this node failed its reduction between nodes (its error says "
                                    "why): no rank of the node puts this step's shards back together")
        if error is not None:
            for call in open_calls:
                call.result.set_exception(error)
            raise error
        gathers = []  # each shard's all-gather starts as its average arrives; the next one's travels meanwhile
        for call in open_calls:
            assert call.across is not None  # every call was posted above
            averaged = call.across.wait()
            if call.shards is not None:
                call.buffer[:averaged.numel()].copy_(averaged)
                gathered = call.buffer.new_empty(local_size * call.shards.shard_numel)
                gathers.append((call, gathered, all_gather_single(gathered, call.buffer, group=self.groups.node_group,
                                                                  async_op=True)))
                self.node_bytes += (local_size - 1) * call.buffer.numel() * call.buffer.element_size()
                continue
            total = averaged
            if call.rows and local_size > 1:
                total, sent = node_rows.put_together(averaged, call.buffer, self.groups.node_group)
                self.node_bytes += sent
                if self.average:
                    total = total.div_(local_size)
            call.result.set_result(call.finish(total))
        for call, gathered, work in gathers:
            assert call.shards is not None
            wait_for(work, gathered.device)
            total = call.shards.from_shards(gathered)
            call.result.set_result(call.finish(total.div_(local_size) if self.average else total))

    # -- lifetime and checkpoints -----------------------------------------------------------------
    def close(self) -> None:
        """Wait for calls in flight and stop the hop between nodes (its worker thread)."""
        self.across.close()

    def __enter__(self) -> HierarchicalReducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _where(self) -> list[int]:
        return [self.groups.nodes, self.groups.topology.local_size, self.groups.local_rank]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (format `FORMAT`): its shards' state across nodes and where it sits.
        Every rank saves its own; it resumes on the same topology."""
        return {"format": FORMAT, "topology": self._where(), "bucket_orders": self.buckets.state_dict(),
                "across": self.across.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned on this rank.

        Raises:
            SparseCommError: the checkpoint is of another format, or from another topology or place in it.
        """
        check_owner(state, "HierarchicalReducer")
        if state.get("format") != FORMAT:
            raise SparseCommError(f"a HierarchicalReducer checkpoint of format {state.get('format')!r}; this version "
                                  f"reads format {FORMAT}")
        saved, here = list(state["topology"]), self._where()
        if saved != here:
            raise SparseCommError("the checkpoint is from {} nodes × {} ranks, local rank {}; this run is {} nodes × "
                                  "{} ranks, local rank {}: each rank's feedback holds its own shard, so resume on "
                                  "the same topology".format(*saved, *here))
        self.across.load_state_dict(state["across"])
        self.buckets.load_state_dict(state["bucket_orders"])
