"""Value codecs; see each module for its wire format."""

from sparsecomm.encode.value import deflate, dexp, floats, int8, polyfit, qsgd, zstd

__all__ = ["deflate", "dexp", "floats", "int8", "polyfit", "qsgd", "zstd"]
