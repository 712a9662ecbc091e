"""Value codecs; see each module for its wire format."""

from sparsecomm.encode.value import deflate, dexp, floats, polyfit, qsgd, zstd

__all__ = ["deflate", "dexp", "floats", "polyfit", "qsgd", "zstd"]
