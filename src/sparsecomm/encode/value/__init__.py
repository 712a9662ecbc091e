"""Value codecs; see each module for its wire format."""

from sparsecomm.encode.value import deflate, floats, qsgd, zstd

__all__ = ["deflate", "floats", "qsgd", "zstd"]
