"""The library's error types. Every error sparsecomm raises on bad input is a ValueError subclass."""

from __future__ import annotations


class SparseCommError(ValueError):
    """Base class: bad input, bad configuration, or a payload that cannot be trusted."""


class SpecError(SparseCommError):
    """A pipeline spec string or component name/parameter is invalid."""


class PayloadError(SparseCommError):
    """A payload is truncated, corrupted, of another format version, or internally inconsistent."""
