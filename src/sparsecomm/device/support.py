"""Which pipelines the device path runs: every stage with a form in fixed-size tensor ops; and a
pipeline's device form, which takes the place of its host codecs — for ``adaptive``'s sparse steps
where its trials find it faster, for a pipeline on ``rle`` indices where every rank's gradients are
on a GPU (`sparsecomm.reducer.config.ReducerConfig.gpus_take_device_form`)."""

from __future__ import annotations

from dataclasses import replace

from sparsecomm.device import values
from sparsecomm.encode.index.packed import PackedIndices
from sparsecomm.encode.index.raw import RawIndices
from sparsecomm.feedback.dgc_momentum import DGCMomentum
from sparsecomm.feedback.none import NoFeedback
from sparsecomm.feedback.residual import Residual
from sparsecomm.sparsify.adaptive import Adaptive
from sparsecomm.sparsify.dgc_threshold import DGCThreshold
from sparsecomm.spec import PipelineSpec
from sparsecomm.transport.allgather import AllgatherTransport


def device_native(spec: PipelineSpec) -> str | None:
    """None where ``spec`` runs on the device path, else why not.

    It runs there with DGC's sampled threshold at a ratio (its count is near k, not exactly k, as
    DGC's own is) or ``adaptive`` (its sparse steps, at the planned density), error feedback, DGC's
    momentum without local clipping, or no feedback, raw 32-bit or packed indices with fp32, fp16,
    bf16 or int8 values (in a fixed buffer), and the allgather transport.
    """
    sparsifier, feedback = spec.sparsifier, spec.feedback
    if not (isinstance(sparsifier, Adaptive) or isinstance(sparsifier, DGCThreshold) and sparsifier.ratio is not None):
        return "its sparsifier is not dgc(ratio=...) or adaptive"
    if not isinstance(feedback, NoFeedback | Residual | DGCMomentum):
        return f"its feedback {feedback.name} has no device form"
    if isinstance(feedback, DGCMomentum) and feedback.clip > 0:
        return "dgc_momentum's local clipping has no device form yet"
    if spec.index_codec not in (RawIndices(bits=32), PackedIndices()):
        return f"its index codec {spec.index_codec.name} is not raw (32-bit) or packed"
    if not values.supported(spec.value_codec):
        return f"its value codec {spec.value_codec.name} is not fp32, fp16, bf16 or int8"
    if not isinstance(spec.transport, AllgatherTransport):
        return f"its transport {spec.transport.name} is not allgather"
    return None


def device_form(spec: PipelineSpec) -> PipelineSpec | None:
    """The pipeline ``spec``'s compressed calls run on the device route in place of its codecs: the
    same sparsifier, feedback, value codec and transport, with ``packed`` indices (near the entropy
    codecs' size at ``adaptive``'s densities, fewer bytes than ``rle`` at DGC's, in tensor ops)
    where its index codec has no device form. None where another stage has none, where an
    ``adaptive`` sparsifier's ``device_route`` is ``never``, or where ``spec`` runs on the device
    path already."""
    if isinstance(spec.sparsifier, Adaptive) and spec.sparsifier.device_route == "never":
        return None
    if device_native(spec) is None:
        return None
    form = spec if spec.index_codec in (RawIndices(bits=32), PackedIndices()) else replace(
        spec, index_codec=PackedIndices())
    return form if device_native(form) is None else None
