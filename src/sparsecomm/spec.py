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

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from sparsecomm.errors import SpecError
from sparsecomm.registry import Component, ParamValue, Registry, kind_of

if TYPE_CHECKING:
    from sparsecomm.encode.base import IndexCodec, ValueCodec
    from sparsecomm.feedback.base import Feedback
    from sparsecomm.sparsify.base import Sparsifier
    from sparsecomm.transport.base import Transport

_STAGE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*?)\))?\s*$", re.DOTALL)
_PARAM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([^,=()\s]+)\s*$")
_INT = re.compile(r"[+-]?\d+$")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*$")
MAX_SPEC_LENGTH = 1024


def parse_value(text: str) -> ParamValue:
    if _INT.match(text):
        return int(text)
    if text in ("true", "false"):
        return text == "true"
    try:
        return float(text)
    except ValueError:
        pass
    if _WORD.match(text):
        return text
    raise SpecError(f"cannot read parameter value {text!r}")


def format_value(value: ParamValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_stage(name: str, params: dict[str, ParamValue]) -> str:
    if not params:
        return name
    inner = ",".join(f"{key}={format_value(value)}" for key, value in params.items())
    return f"{name}({inner})"


def split_stages(spec: str) -> list[tuple[str, dict[str, ParamValue]]]:
    """``"a(x=1)+b"`` → ``[("a", {"x": 1}), ("b", {})]``; syntax only, no registry look-up."""
    if not isinstance(spec, str):
        raise SpecError(f"a spec is a string, got {type(spec).__name__}")
    if len(spec) > MAX_SPEC_LENGTH:
        raise SpecError(f"spec longer than {MAX_SPEC_LENGTH} characters")
    stages = []
    for part in _split_top_level(spec):
        match = _STAGE.match(part)
        if not match:
            raise SpecError(f"cannot read stage {part.strip()!r} in spec {spec!r}")
        name, inner = match.group(1), match.group(2)
        params: dict[str, ParamValue] = {}
        if inner is not None and inner.strip():
            for item in inner.split(","):
                pmatch = _PARAM.match(item)
                if not pmatch:
                    raise SpecError(f"cannot read parameter {item.strip()!r} of {name!r}")
                key = pmatch.group(1)
                if key in params:
                    raise SpecError(f"parameter {key!r} given twice to {name!r}")
                params[key] = parse_value(pmatch.group(2))
        stages.append((name, params))
    return stages


def _split_top_level(spec: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for pos, char in enumerate(spec):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise SpecError(f"unbalanced ')' in spec {spec!r}")
        elif char == "+" and depth == 0:
            parts.append(spec[start:pos])
            start = pos + 1
    if depth != 0:
        raise SpecError(f"unbalanced '(' in spec {spec!r}")
    parts.append(spec[start:])
    if any(not p.strip() for p in parts):
        raise SpecError(f"empty stage in spec {spec!r}")
    return parts


def parse_component(registry: Registry, text: str) -> Component:
    """One stage of a given kind, e.g. ``parse_component(VALUE_CODECS, "qsgd(bits=4)")``."""
    stages = split_stages(text)
    if len(stages) != 1:
        raise SpecError(f"expected one {registry.kind}, got {text!r}")
    name, params = stages[0]
    return registry.create(name, params)


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


def parse_spec(spec: str | PipelineSpec) -> PipelineSpec:
    """Read a pipeline spec string (see the module docstring)."""
    from sparsecomm import components

    if isinstance(spec, PipelineSpec):
        return spec
    registries = components.registries()
    chosen: dict[str, Component] = {}
    for name, params in split_stages(spec):
        kind = kind_of(name)
        if kind is None:
            valid = "; ".join(f"{k}: {', '.join(r.names())}" for k, r in registries.items())
            raise SpecError(f"unknown component {name!r} in spec {spec!r}; valid names — {valid}")
        if kind in chosen:
            raise SpecError(f"spec {spec!r} names two {kind} stages: {chosen[kind].name!r}, {name!r}")
        chosen[kind] = registries[kind].create(name, params)
    explicit = set(chosen)
    for kind in _STAGE_ORDER:
        if kind not in chosen:
            chosen[kind] = registries[kind].create(_DEFAULTS[kind])
    _check_codecs(spec, chosen, explicit_value="value" in explicit)
    return PipelineSpec(
        cast("Sparsifier", chosen["sparsifier"]),
        cast("Feedback", chosen["feedback"]),
        cast("IndexCodec", chosen["index"]),
        cast("ValueCodec", chosen["value"]),
        cast("Transport", chosen["transport"]),
    )


def _check_codecs(spec: str, chosen: dict[str, Component], explicit_value: bool) -> None:
    """Codec combinations that would silently not do what the spec says are errors."""
    from sparsecomm.encode.base import IndexCodec, ValueCodec, codecs_lossless
    from sparsecomm.transport.base import Transport

    index, value, transport = chosen["index"], chosen["value"], chosen["transport"]
    assert isinstance(index, IndexCodec) and isinstance(value, ValueCodec) and isinstance(transport, Transport)
    if index.codes_values and explicit_value:
        raise SpecError(f"spec {spec!r}: {index.name!r} codes the values itself; leave the value codec out")
    if not transport.carries_payloads and not codecs_lossless(index, value):
        lossy = index if not index.lossless or index.codes_values else value
        raise SpecError(f"spec {spec!r}: the lossy {lossy.kind} codec {lossy.name!r} needs a transport that sends "
                        f"payloads (allgather); {transport.name!r} would not use it")


def format_spec(spec: PipelineSpec) -> str:
    return "+".join(
        c.to_spec() for c in (spec.sparsifier, spec.feedback, spec.index_codec, spec.value_codec, spec.transport)
    )
