"""Index codecs. All are lossless except ``bloom``; see each module for its wire format."""

from sparsecomm.encode.index import bitmap, bloom, delta_binary, huffman, packed, raw, rice, rle

__all__ = ["bitmap", "bloom", "delta_binary", "huffman", "packed", "raw", "rice", "rle"]
