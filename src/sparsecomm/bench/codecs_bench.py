"""``sparsecomm bench codecs``: size, speed and error of every index and value codec on one sparse
gradient per density, side by side, next to the information bound."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm

from sparsecomm.bench.bounds import subset_bits_per_index
from sparsecomm.bench.sources import make_gradient
from sparsecomm.bench.timing import time_ms
from sparsecomm.encode.base import IndexCodec, ValueCodec
from sparsecomm.payload import decode, encode, read_info
from sparsecomm.registry import INDEX_CODECS, VALUE_CODECS
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.topk import TopK
from sparsecomm.spec import parse_component

REFERENCE_INDEX = "rice"
REFERENCE_VALUE = "fp16"


def default_pairs() -> list[tuple[str, str]]:
    """Each index codec with fp16 values, then each value codec with rice indices."""
    pairs = [(name, REFERENCE_VALUE) for name in INDEX_CODECS.names()]
    pairs += [(REFERENCE_INDEX, name) for name in VALUE_CODECS.names() if name != REFERENCE_VALUE]
    pairs += [(REFERENCE_INDEX, f"qsgd(bits={bits})") for bits in (2, 4)]
    return pairs


def measure(selection: SparseGradient, index_text: str, value_text: str, repeat: int) -> dict[str, Any]:
    """One (index codec, value codec) pair on one sparse gradient."""
    index_codec = cast(IndexCodec, parse_component(INDEX_CODECS, index_text))
    value_codec = cast(ValueCodec, parse_component(VALUE_CODECS, value_text))
    encode_ms, payload = time_ms(
        lambda: encode(selection, index_codec, value_codec, rng=np.random.default_rng(0)), repeat
    )
    decode_ms, decoded = time_ms(lambda: decode(payload), repeat)
    info = read_info(payload)
    nnz = max(selection.nnz, 1)
    indices_equal = torch.equal(decoded.indices, selection.indices)
    error = (decoded.values.float() - selection.values.float()).abs()
    bound = subset_bits_per_index(selection.numel, selection.nnz)
    index_bits = 8 * info.index_bytes / nnz
    return {
        "index_codec": index_codec.to_spec(),
        "value_codec": value_codec.to_spec(),
        "numel": selection.numel,
        "density": selection.density,
        "nnz": selection.nnz,
        "index_bits_per_nnz": index_bits,
        "value_bits_per_nnz": 8 * info.value_bytes / nnz,
        "bound_bits_per_nnz": bound,
        "index_over_bound_pct": 100.0 * (index_bits / bound - 1.0) if bound else 0.0,
        "payload_bytes": info.total_bytes,
        "encode_ms": encode_ms,
        "decode_ms": decode_ms,
        "max_abs_error": float(error.max()) if error.numel() else 0.0,
        "rel_l2_error": float(error.norm() / selection.values.float().norm().clamp_min(1e-30)),
        "lossless": bool(indices_equal and torch.equal(decoded.values, selection.values)),
    }


def run(numel: int, densities: list[float], source: str = "normal", repeat: int = 5, seed: int = 0,
        pairs: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    grad = make_gradient(source, numel, seed)
    pairs = pairs or default_pairs()
    rows = []
    with tqdm(total=len(pairs) * len(densities), desc="codecs", disable=None) as progress:
        for density in densities:
            selection = TopK(ratio=density).sparsify(grad).sorted()
            for index_text, value_text in pairs:
                rows.append(measure(selection, index_text, value_text, repeat))
                progress.update()
    return {"benchmark": "codecs", "numel": grad.numel(), "densities": densities, "source": source,
            "repeat": repeat, "threads": torch.get_num_threads(), "rows": rows}
