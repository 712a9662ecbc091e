"""The spec grammar alone: reading and writing stage texts such as ``qsgd(bits=4)+rice``, with no
knowledge of which components exist (`sparsecomm.spec` resolves names through the registries).

    pipeline := stage ("+" stage)*
    stage    := NAME ["(" [param ("," param)*] ")"]
    param    := NAME "=" VALUE            VALUE: integer, float, true, false or a bare word
"""

from __future__ import annotations

import re

from sparsecomm.errors import SpecError

ParamValue = int | float | bool | str

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
