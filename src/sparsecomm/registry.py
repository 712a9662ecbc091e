"""Registries of pipeline components by name, and the base class that makes a component's
parameters readable from and printable to a spec string."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

from sparsecomm.errors import SpecError
from sparsecomm.spec_grammar import ParamValue, format_stage, split_stages


class Component:
    """Base of every registered component: a frozen dataclass whose fields are its parameters."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""

    def params(self) -> dict[str, ParamValue]:
        """Parameters that differ from their defaults, in declaration order."""
        out: dict[str, ParamValue] = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if field.default is not dataclasses.MISSING and value == field.default:
                continue
            out[field.name] = value
        return out

    def to_spec(self) -> str:
        return format_stage(self.name, self.params())


C = TypeVar("C", bound=Component)

_ALL_NAMES: dict[str, str] = {}  # name -> kind, so a bare name in a spec resolves unambiguously


class Registry(Generic[C]):
    """Components of one kind by name; ``@REGISTRY.register("name")`` adds a class."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[C]] = {}

    def register(self, name: str) -> Callable[[type[C]], type[C]]:
        def add(cls: type[C]) -> type[C]:
            if name in _ALL_NAMES:
                raise RuntimeError(f"component name {name!r} is already a {_ALL_NAMES[name]}")
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} must be a dataclass")
            cls.name = name
            cls.kind = self.kind
            self._classes[name] = cls
            _ALL_NAMES[name] = self.kind
            return cls

        return add

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def get(self, name: str) -> type[C]:
        try:
            return self._classes[name]
        except KeyError:
            raise SpecError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}"
            ) from None

    def parse(self, text: str) -> C:
        """One stage of this kind from its text, e.g. ``VALUE_CODECS.parse("qsgd(bits=4)")``."""
        stages = split_stages(text)
        if len(stages) != 1:
            raise SpecError(f"expected one {self.kind}, got {text!r}")
        name, params = stages[0]
        return self.create(name, params)

    def create(self, name: str, params: Mapping[str, ParamValue] | None = None) -> C:
        """An instance of ``name`` with ``params`` converted to the declared field types."""
        cls = self.get(name)
        hints = _field_types(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {}
        for key, value in (params or {}).items():
            if key not in fields:
                valid = ", ".join(fields) or "none"
                raise SpecError(f"{self.kind} {name!r} has no parameter {key!r}; parameters: {valid}")
            kwargs[key] = _coerce(value, hints[key], f"{name}.{key}")
        try:
            return cls(**kwargs)
        except SpecError:
            raise
        except (TypeError, ValueError) as err:
            raise SpecError(f"{self.kind} {name!r}: {err}") from None


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    """A component's resolved annotations, once per class (resolving compiles each string
    annotation, which is too slow to repeat on every payload decode)."""
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return _FIELD_TYPES[cls]


def kind_of(name: str) -> str | None:
    """The registry kind a component name belongs to, or None."""
    return _ALL_NAMES.get(name)


def _coerce(value: ParamValue, annotation: Any, where: str) -> ParamValue:
    """Convert a parsed literal to a field's annotated type (``int``, ``float``, ``bool``, ``str``,
    optionally ``| None``)."""
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    allowed = tuple(t for t in allowed if t is not type(None))
    for target in allowed:
        if target is bool and isinstance(value, bool):
            return value
        if target is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if target is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if target is float and isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise SpecError(f"{where} must be finite, got {value!r}")
            return float(value)
        if target is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise SpecError(f"{where} must be {names}, got {value!r}")
