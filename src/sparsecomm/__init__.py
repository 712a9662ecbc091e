"""sparsecomm: communication-efficient data-parallel training.

A pipeline is sparsify → feedback → encode (index codec + value codec) → transport → decode,
named by one spec string such as ``"topk(ratio=0.01)+residual+rice+fp16"``.
"""

from sparsecomm import components  # every component, loaded in one place (fills the registries)
from sparsecomm.encode.base import INDEX_CODECS, VALUE_CODECS
from sparsecomm.errors import PayloadError, SparseCommError, SpecError
from sparsecomm.feedback.base import FEEDBACKS
from sparsecomm.host_memory import keep_freed_host_memory
from sparsecomm.integration.ddp_hook import ddp_comm_hook, register_ddp_hook
from sparsecomm.integration.gradients import allreduce_gradients, check_optimizer
from sparsecomm.integration.presets import PRESETS, available_presets, resolve
from sparsecomm.integration.reducer import GradientReducer
from sparsecomm.payload import PayloadInfo, as_tensor, decode, encode, read_info
from sparsecomm.pipeline import Pipeline
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.base import SPARSIFIERS
from sparsecomm.spec import PipelineSpec, format_spec, parse_spec
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.base import TRANSPORTS, Transport
from sparsecomm.transport.cost_model import CostModel, load_cost_model
from sparsecomm.transport.request import Agreement, CallRecord, Reduction, Request
from sparsecomm.transport.session import TransportSession

__version__ = "0.1.0"

__all__ = [
    "components",
    "PRESETS",
    "FEEDBACKS",
    "INDEX_CODECS",
    "SPARSIFIERS",
    "TRANSPORTS",
    "VALUE_CODECS",
    "CostModel",
    "GradientReducer",
    "PayloadError",
    "PayloadInfo",
    "Pipeline",
    "PipelineSpec",
    "SparseCommError",
    "SparseGradient",
    "Reduction",
    "Request",
    "Agreement",
    "CallRecord",
    "TransportSession",
    "SpecError",
    "Transport",
    "allreduce_gradients",
    "as_tensor",
    "available_presets",
    "check_optimizer",
    "decode",
    "encode",
    "format_spec",
    "keep_freed_host_memory",
    "load_cost_model",
    "parse_spec",
    "read_info",
    "register_ddp_hook",
    "ddp_comm_hook",
    "agree",
    "resolve",
]
