"""sparsecomm: communication-efficient data-parallel training.

A pipeline is sparsify → feedback → encode (index codec + value codec) → transport → decode,
named by one spec string such as ``"topk(ratio=0.01)+residual+rice+fp16"`` or a preset (`PRESETS`).
Train with it through DDP (`register_ddp_hook`) or any loop (`GradientReducer.allreduce_`).

What is exported here is what a user calls; every other piece is importable from its module
(every component class from `sparsecomm.components`, a transport call's `Request` and
`TransportSession` from `sparsecomm.transport.request` and `sparsecomm.transport.session`)."""

from sparsecomm import components as components  # every component, loaded in one place (fills the registries)
from sparsecomm.encode.base import INDEX_CODECS, VALUE_CODECS
from sparsecomm.errors import NonFiniteError, PayloadError, SparseCommError, SpecError
from sparsecomm.feedback.base import FEEDBACKS
from sparsecomm.host_memory import keep_freed_host_memory
from sparsecomm.payload import decode, encode, read_info
from sparsecomm.pipeline import Pipeline
from sparsecomm.presets import PRESETS, available_presets
from sparsecomm.reducer.custom_loop import allreduce_gradients, check_optimizer
from sparsecomm.reducer.ddp_hook import ddp_comm_hook, register_ddp_hook
from sparsecomm.reducer.fsdp_hook import register_fsdp_hooks
from sparsecomm.reducer.hierarchical import HierarchicalReducer
from sparsecomm.reducer.reducer import GradientReducer
from sparsecomm.reducer.topology import Topology
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS
from sparsecomm.spec import parse_spec
from sparsecomm.transport.base import TRANSPORTS

__version__ = "0.1.0"

__all__ = [
    # training
    "GradientReducer",
    "HierarchicalReducer",
    "Topology",
    "register_fsdp_hooks",
    "register_ddp_hook",
    "ddp_comm_hook",
    "allreduce_gradients",
    "check_optimizer",
    # pipelines, presets and their components by name
    "Pipeline",
    "PRESETS",
    "available_presets",
    "parse_spec",
    "SPARSIFIERS",
    "FEEDBACKS",
    "INDEX_CODECS",
    "VALUE_CODECS",
    "TRANSPORTS",
    # payloads
    "SparseGradient",
    "encode",
    "decode",
    "read_info",
    # errors
    "SparseCommError",
    "SpecError",
    "PayloadError",
    "NonFiniteError",
    # the host
    "keep_freed_host_memory",
]
