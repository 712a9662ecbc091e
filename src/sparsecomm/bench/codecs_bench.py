"""``sparsecomm bench codecs``: size, speed and error of every index and value codec on one sparse
gradient per density, side by side, next to the information bound.

Suites: ``all`` (every index codec with fp16 values, every value codec with rice indices),
``deepreduce`` (the combinations of DeepReduce's Figure 10 and Table 2 next to top-k's raw
32-bit indices and values, and to our lossless rice indices) and ``skcompress`` (SKCompress with
Huffman and ANS next to QSGD at 2, 4 and 8 bits and fp16). A joint codec (``skcompress``) counts
keys and values in ``index_bits_per_nnz``; compare ``total_bits_per_nnz``. Errors are measured on the dense
tensors, against the selection the codecs were given (``rel_l2_error``) and against the whole
gradient (``grad_rel_l2_error``; top-k alone already loses something there): a lossy index codec
may decode to other indices than it was given, and P0 sends the gradient's true values there."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sparsecomm.bench.bounds import subset_bits_per_index
from sparsecomm.bench.sources import make_gradient
from sparsecomm.bench.timing import time_ms
from sparsecomm.encode.base import INDEX_CODECS, VALUE_CODECS
from sparsecomm.errors import SparseCommError, SpecError
from sparsecomm.payload import JOINT_VALUE_SPEC, decode, encode, read_info
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.topk import TopK

REFERENCE_INDEX = "rice"
REFERENCE_VALUE = "fp16"


def default_pairs() -> list[tuple[str, str]]:
    """Each index codec with fp16 values, then each value codec with rice indices."""
    pairs = [(name, JOINT_VALUE_SPEC if INDEX_CODECS.get(name).codes_values else REFERENCE_VALUE)
             for name in INDEX_CODECS.names()]
    pairs += [(REFERENCE_INDEX, name) for name in VALUE_CODECS.names() if name != REFERENCE_VALUE]
    pairs += [(REFERENCE_INDEX, f"qsgd(bits={bits})") for bits in (2, 4)]
    return pairs


DEEPREDUCE_QSGD = "qsgd(bits=8,bucket=512)"  # the paper's 7-bit QSGD: 127 levels and a sign
DEEPREDUCE_PAIRS = [
    ("raw", "fp32"),  # what top-k sends on its own
    *[(f"bloom(policy={policy})", "fp32") for policy in ("naive", "leftmost", "p0", "p1", "p2")],
    ("raw", "polyfit"), ("raw", "dexp"), ("raw", DEEPREDUCE_QSGD),
    ("bloom(policy=p2)", "polyfit"),  # Figure 9's DR BF-P2 (FPR 0.001) with Fit-Poly
    ("bloom(policy=p2,fpr=0.01)", "polyfit"),  # Table 2's DR BF-P2 Fit-Poly
    ("bloom(policy=p0,fpr=0.6)", DEEPREDUCE_QSGD),  # Table 2's DR BF-P0 QSGD
    ("bloom(policy=p0)", DEEPREDUCE_QSGD),
    ("skcompress", JOINT_VALUE_SPEC),
    ("rice", "fp32"), ("rice", "polyfit"), ("rice", DEEPREDUCE_QSGD),  # lossless near-entropy indices
]
SKCOMPRESS_PAIRS = [
    ("rice", "fp16"), *[("rice", f"qsgd(bits={bits},bucket=512)") for bits in (2, 4, 8)],
    *[(f"skcompress({options})", JOINT_VALUE_SPEC) for options in
      ("coder=huffman", "coder=ans", "coder=ans,keys=rice", "bins=16,groups=2,coder=ans",
       "bins=16,groups=2,coder=ans,keys=rice", "bins=4,groups=2,coder=ans,keys=rice")],
]
SUITES = {"all": default_pairs, "deepreduce": lambda: list(DEEPREDUCE_PAIRS),
          "skcompress": lambda: list(SKCOMPRESS_PAIRS)}


def measure(selection: SparseGradient, index_text: str, value_text: str, repeat: int,
            dense: torch.Tensor | None = None) -> dict[str, Any]:
    """One (index codec, value codec) pair on one sparse gradient taken from ``dense``: encoded
    from the selection's device and decoded back onto it (on a GPU, the copies are in the times)."""
    index_codec = INDEX_CODECS.parse(index_text)
    value_codec = VALUE_CODECS.parse(value_text)
    device = selection.device
    encode_ms, payload = time_ms(
        lambda: encode(selection, index_codec, value_codec, rng=np.random.default_rng(0), dense=dense), repeat, device
    )
    decode_ms, decoded = time_ms(lambda: decode(payload, device=device, expect=selection.shape), repeat, device)
    info = read_info(payload)
    nnz = max(selection.nnz, 1)
    indices_equal = torch.equal(decoded.indices, selection.indices)
    sent = selection.to_dense().reshape(-1).float()
    error = decoded.to_dense().reshape(-1).float() - sent
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
        "total_bits_per_nnz": 8 * (info.index_bytes + info.value_bytes) / nnz,
        "bound_bits_per_nnz": bound,
        "index_over_bound_pct": 100.0 * (index_bits / bound - 1.0) if bound else 0.0,
        "decoded_nnz": info.nnz,
        "payload_bytes": info.total_bytes,
        "volume_vs_dense": info.total_bytes / (4 * max(selection.numel, 1)),
        "encode_ms": encode_ms,
        "decode_ms": decode_ms,
        "max_abs_error": float(error.abs().max()) if error.numel() else 0.0,
        "rel_l2_error": float(error.norm() / sent.norm().clamp_min(1e-30)),
        "grad_rel_l2_error": float((decoded.to_dense().reshape(-1).float() - dense.float()).norm()
                                   / dense.float().norm().clamp_min(1e-30)) if dense is not None else None,
        "lossless": bool(indices_equal and torch.equal(decoded.values, selection.values)),
    }


def run(numel: int, densities: list[float], source: str = "normal", repeat: int = 5, seed: int = 0,
        pairs: list[tuple[str, str]] | None = None, device: str = "cpu") -> dict[str, Any]:
    grad = make_gradient(source, numel, seed).to(device)
    pairs = pairs or default_pairs()
    rows, refused = [], []
    with tqdm(total=len(pairs) * len(densities), desc="codecs", disable=None) as progress:
        for density in densities:
            selection = TopK(ratio=density).sparsify(grad).sorted()
            for index_text, value_text in pairs:
                try:
                    rows.append(measure(selection, index_text, value_text, repeat, dense=grad))
                except SparseCommError as err:  # e.g. a Bloom filter with too many false positives
                    if isinstance(err, SpecError):
                        raise
                    refused.append({"density": density, "index_codec": index_text, "value_codec": value_text,
                                    "error": str(err)})
                progress.update()
    return {"benchmark": "codecs", "device": str(grad.device), "numel": grad.numel(), "densities": densities,
            "source": source, "repeat": repeat, "threads": torch.get_num_threads(), "rows": rows, "refused": refused}


def plot(result: dict[str, Any], path: str) -> None:
    """DeepReduce Figure 10's two panels for each density: bits per selected value split into index
    and value (bars), and encode / decode time (log scale); relative error printed on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    densities = sorted({row["density"] for row in result["rows"]})
    figure, axes = plt.subplots(len(densities), 2, figsize=(13, 0.9 + 0.32 * len(result["rows"])), squeeze=False)
    for (volume, runtime), density in zip(axes, densities, strict=True):
        rows = [row for row in result["rows"] if row["density"] == density]
        labels = [f"{row['index_codec']} / {row['value_codec']}" for row in rows]
        positions = range(len(rows))
        index_bits = [row["index_bits_per_nnz"] for row in rows]
        value_bits = [row["value_bits_per_nnz"] for row in rows]
        volume.barh(positions, index_bits, label="indices")
        volume.barh(positions, value_bits, left=index_bits, label="values")
        totals = sorted(row["total_bits_per_nnz"] for row in rows)
        limit = 1.3 * totals[-2] if len(totals) > 1 and totals[-1] > 2 * totals[-2] else 1.15 * totals[-1]
        for y, row in zip(positions, rows, strict=True):
            total = row["total_bits_per_nnz"]
            note = f" err {row['rel_l2_error']:.2g}" + (f" ({total:,.0f} bits, clipped)" if total > limit else "")
            volume.text(min(total, limit), y, note, va="center", fontsize=7)
        volume.set(yticks=list(positions), yticklabels=labels, xlabel="bits per selected value", xlim=(0, limit),
                   title=f"data volume, density {density:.3g} of {result['numel']:,}")
        volume.invert_yaxis()
        volume.legend(loc="lower right", fontsize=8)
        height = 0.4
        runtime.barh([p - height / 2 for p in positions], [row["encode_ms"] for row in rows], height, label="encode")
        runtime.barh([p + height / 2 for p in positions], [row["decode_ms"] for row in rows], height, label="decode")
        runtime.set(yticks=list(positions), yticklabels=[], xscale="log", xlabel="ms (log)", title="run time")
        runtime.invert_yaxis()
        runtime.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
