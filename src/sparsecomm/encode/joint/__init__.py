"""Joint codecs: indices and values coded together in one section (registered as index codecs)."""

from sparsecomm.encode.joint import skcompress

__all__ = ["skcompress"]
