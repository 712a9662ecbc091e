"""Codecs for gradients that must arrive exactly: the pipeline's own where they decode to what was
encoded, else Rice indices and the values' own float format (Zstandard for formats with no raw
codec) — `exact_codecs`; on a step whose link carries the whole gradient, raw indices and the
values' own format, the cheapest to encode and decode (`raw_codecs`). Already-sparse gradients
(embedding rows) take no error feedback, so nothing would carry a lossy codec's error forward: what
a lossy codec dropped would be lost for good."""

from __future__ import annotations

import torch

from sparsecomm.encode.base import IndexCodec, ValueCodec
from sparsecomm.encode.index.raw import RawIndices
from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.encode.value.floats import BFloat16Values, Float16Values, Float32Values
from sparsecomm.encode.value.zstd import ZstdValues


def exact_codecs(index_codec: IndexCodec, value_codec: ValueCodec,
                 dtype: torch.dtype) -> tuple[IndexCodec, ValueCodec]:
    """(index codec, value codec) that carry values of ``dtype`` exactly, keeping the given ones
    where they already do."""
    if index_codec.codes_values and index_codec.lossless and index_codec.values_lossless:
        return index_codec, value_codec
    exact_index = index_codec if index_codec.lossless and not index_codec.codes_values else RiceIndices()
    if value_codec.lossless_for(dtype):
        return exact_index, value_codec
    return exact_index, _own_format(dtype)


def raw_codecs(dtype: torch.dtype, numel: int) -> tuple[IndexCodec, ValueCodec]:
    """(raw indices, the values' own float format): exact, and the cheapest to encode and decode —
    for a step whose link carries the whole gradient, where the processor's time counts for more
    than the bytes. ``numel``: the gradient's size, which sets the indices' width."""
    return RawIndices(bits=32 if numel <= 2**31 else 64), _own_format(dtype)


def _own_format(dtype: torch.dtype) -> ValueCodec:
    """The value codec that sends ``dtype`` as it is (Zstandard for formats with no raw codec)."""
    raw = {torch.float32: Float32Values(), torch.float16: Float16Values(), torch.bfloat16: BFloat16Values()}
    return raw.get(dtype, ZstdValues())
