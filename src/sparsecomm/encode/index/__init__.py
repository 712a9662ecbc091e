"""Index codecs. All are lossless; see each module for its wire format."""

from sparsecomm.encode.index import bitmap, delta_binary, huffman, raw, rice, rle

__all__ = ["bitmap", "delta_binary", "huffman", "raw", "rice", "rle"]
