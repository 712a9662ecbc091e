"""Imports every built-in component so the registries are full, and lists them by kind."""

from __future__ import annotations

from sparsecomm import feedback, sparsify, transport  # noqa: F401  (registration side effects)
from sparsecomm.encode import index, joint, value  # noqa: F401
from sparsecomm.registry import FEEDBACKS, INDEX_CODECS, SPARSIFIERS, TRANSPORTS, VALUE_CODECS, Registry


def registries() -> dict[str, Registry]:
    return {
        "sparsifier": SPARSIFIERS,
        "feedback": FEEDBACKS,
        "index": INDEX_CODECS,
        "value": VALUE_CODECS,
        "transport": TRANSPORTS,
    }
