"""Pipeline spec strings: one string names a whole pipeline, in Python and on the command line.

Grammar (whitespace around tokens is ignored)::

    pipeline := stage ("+" stage)*
    stage    := NAME ["(" [param ("," param)*] ")"]
    param    := NAME "=" VALUE            VALUE: integer, float, true, false or a bare word

Each stage names a registered sparsifier, feedback, index codec, value codec or transport, at most
one of each, in any order. Missing stages take defaults: ``nonzero`` (keep the input's nonzeros),
``none`` feedback, ``raw`` indices, ``fp32`` values, ``allgather`` transport.
Example: ``topk(ratio=0.01)+residual+rice+fp16+sparse_allreduce(algorithm=ssar_sa)``.
``format_spec(parse_spec(s))`` always lists all five stages in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from sparsecomm.encode.base import INDEX_CODECS, VALUE_CODECS, IndexCodec, ValueCodec, codecs_lossless
from sparsecomm.errors import SpecError
from sparsecomm.feedback.base import FEEDBACKS, Feedback
from sparsecomm.registry import Component, Registry, kind_of
from sparsecomm.sparsify.base import SPARSIFIERS, Sparsifier
from sparsecomm.spec_grammar import format_stage, format_value, parse_value, split_stages
from sparsecomm.transport.base import TRANSPORTS, Transport

__all__ = ["PipelineSpec", "format_spec", "format_stage", "format_value", "parse_spec", "parse_value", "registries",
           "split_stages"]

@dataclass(frozen=True)
class PipelineSpec:
    """The five stages of a pipeline, as component instances."""

    sparsifier: Sparsifier
    feedback: Feedback
    index_codec: IndexCodec
    value_codec: ValueCodec
    transport: Transport

    def __str__(self) -> str:
        return format_spec(self)


_STAGE_ORDER = ("sparsifier", "feedback", "index", "value", "transport")
_DEFAULTS = {"sparsifier": "nonzero", "feedback": "none", "index": "raw", "value": "fp32", "transport": "allgather"}


def registries() -> dict[str, Registry]:
    """The registry of each kind of stage, in pipeline order."""
    return {"sparsifier": SPARSIFIERS, "feedback": FEEDBACKS, "index": INDEX_CODECS, "value": VALUE_CODECS,
            "transport": TRANSPORTS}


def parse_spec(spec: str | PipelineSpec) -> PipelineSpec:
    """Read a pipeline spec string into its five stages.

    Grammar: ``stage ("+" stage)*``, a stage ``NAME`` or ``NAME(key=value, ...)``; at most one stage
    of each kind, in any order; a missing stage takes its default (``nonzero``, ``none``, ``raw``,
    ``fp32``, ``allgather``). The components are those `sparsecomm.components` loaded (importing
    sparsecomm loads them all). `format_spec` writes the canonical text back. A preset's name is not
    a spec: look it up in `sparsecomm.PRESETS` first.

    Args:
        spec: a spec string, or an already parsed `PipelineSpec` (returned as it is).

    Returns:
        The pipeline's sparsifier, feedback, index codec, value codec and transport.

    Raises:
        SpecError: an unknown component or parameter (the message lists the valid ones), two
            stages of one kind, a parameter of the wrong type or out of range, or codecs the
            stages cannot use together (a lossy codec with a transport that sends no payloads; a
            value codec beside a joint codec).

    Example:
        ```python
        import sparsecomm as sc
        from sparsecomm.spec import format_spec

        spec = sc.parse_spec("topk(ratio=0.01)+residual+rice+fp16")
        print(spec.sparsifier, spec.index_codec.name, spec.transport.name)
        assert format_spec(spec) == "topk(ratio=0.01)+residual+rice+fp16+allgather"
        ```
    """
    if isinstance(spec, PipelineSpec):
        return spec
    kinds = registries()
    chosen: dict[str, Component] = {}
    for name, params in split_stages(spec):
        kind = kind_of(name)
        if kind is None:
            valid = "; ".join(f"{k}: {', '.join(r.names())}" for k, r in kinds.items())
            raise SpecError(f"unknown component {name!r} in spec {spec!r}; valid names — {valid}")
        if kind in chosen:
            raise SpecError(f"spec {spec!r} names two {kind} stages: {chosen[kind].name!r}, {name!r}")
        chosen[kind] = kinds[kind].create(name, params)
    explicit = set(chosen)
    for kind in _STAGE_ORDER:
        if kind not in chosen:
            chosen[kind] = kinds[kind].create(_DEFAULTS[kind])
    _check_codecs(spec, chosen, explicit_value="value" in explicit)
    return PipelineSpec(
        cast(Sparsifier, chosen["sparsifier"]),
        cast(Feedback, chosen["feedback"]),
        cast(IndexCodec, chosen["index"]),
        cast(ValueCodec, chosen["value"]),
        cast(Transport, chosen["transport"]),
    )


def _check_codecs(spec: str, chosen: dict[str, Component], explicit_value: bool) -> None:
    """Codec combinations that would silently not do what the spec says are errors."""
    index, value, transport = chosen["index"], chosen["value"], chosen["transport"]
    assert isinstance(index, IndexCodec) and isinstance(value, ValueCodec) and isinstance(transport, Transport)
    if index.codes_values and explicit_value:
        raise SpecError(f"spec {spec!r}: {index.name!r} codes the values itself; leave the value codec out")
    if not transport.carries_payloads and not codecs_lossless(index, value):
        lossy = index if not index.lossless or index.codes_values else value
        raise SpecError(f"spec {spec!r}: the lossy {lossy.kind} codec {lossy.name!r} needs a transport that sends "
                        f"payloads (allgather); {transport.name!r} would not use it")


def format_spec(spec: PipelineSpec) -> str:
    """The canonical text of ``spec``: its stages in pipeline order — all five, but the value codec
    where the index codec codes the values too — parameters at their defaults left out;
    `parse_spec` reads it back to an equal spec."""
    value = () if spec.index_codec.codes_values else (spec.value_codec,)
    return "+".join(c.to_spec() for c in (spec.sparsifier, spec.feedback, spec.index_codec, *value, spec.transport))
