"""Golden bytes: each codec's wire format, frozen. A failure here means the format changed; if that
was deliberate, bump `FORMAT_VERSION` (when old payloads can no longer be read) and regenerate with
``python tests/test_golden_bytes.py --update``."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sparsecomm as sc

GOLDEN = Path(__file__).parent / "golden" / "payloads.json"

# values exact in fp16 and bf16, gaps that exercise every codec's branches
GRAD = sc.SparseGradient(
    torch.tensor([38, 0, 3, 4, 17, 300]),
    torch.tensor([2.0, 0.5, -1.25, 3.0, -0.0625, 96.0]),
    torch.Size([20, 16]),
)
CASES = {
    **{f"{name}+fp32": (name, "fp32") for name in
       ["raw", "raw(bits=64)", "packed", "bitmap", "rle", "delta_binary", "huffman", "rice", "rice(parameter=2)",
        "rice(parameter=11)", "bloom(policy=p0)", "bloom(policy=p2,fpr=0.1)", "skcompress",
        "skcompress(coder=ans,keys=rice)"]},
    **{f"raw+{name}": ("raw", name) for name in
       ["fp16", "bf16", "qsgd", "qsgd(bits=2,bucket=4)", "int8", "int8(bucket=4)", "deflate",
        "deflate(shuffle=false)", "zstd", "polyfit(degree=2,segments=2)", "dexp"]},
}


def encode_case(index_codec: str, value_codec: str) -> bytes:
    return sc.encode(GRAD, index_codec, value_codec, rng=np.random.default_rng(1234))


# Deflate and Zstandard output depends on the compression library's build, and curve fits on the
# least-squares solver's (LAPACK) rounding, not on our format: for those, the golden payloads must
# still decode, but fresh bytes may differ.
LIBRARY_COMPRESSED = {"raw+deflate", "raw+deflate(shuffle=false)", "raw+zstd", "raw+polyfit(degree=2,segments=2)",
                      "raw+dexp"}


def test_every_registered_codec_has_a_golden_case():
    index_names = {sc.INDEX_CODECS.parse(index).name for index, _ in CASES.values()}
    value_names = {sc.VALUE_CODECS.parse(value).name for _, value in CASES.values()}
    assert index_names == set(sc.INDEX_CODECS.names()), "an index codec without a golden case"
    assert value_names == set(sc.VALUE_CODECS.names()), "a value codec without a golden case"


@pytest.mark.parametrize("case", sorted(set(CASES) - LIBRARY_COMPRESSED))
def test_wire_bytes_are_unchanged(case):
    golden = json.loads(GOLDEN.read_text())
    assert encode_case(*CASES[case]).hex() == golden[case], f"wire format of {case} changed"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_payloads_still_decode(case):
    decoded = sc.decode(bytes.fromhex(json.loads(GOLDEN.read_text())[case]))
    indices, values = [0, 3, 4, 17, 38, 300], [0.5, -1.25, 3.0, -0.0625, 2.0, 96.0]
    if case.startswith("bloom(policy=p0)"):  # all true indices, with their values, plus false positives
        kept = dict(zip(decoded.indices.tolist(), decoded.values.tolist(), strict=True))
        assert [kept[i] for i in indices] == values
        return
    if case.startswith("bloom"):  # p2 keeps as many indices as were sent
        assert decoded.nnz == len(indices)
        return
    assert decoded.indices.tolist() == indices
    if case.startswith(("raw+polyfit", "raw+dexp", "skcompress")):
        assert bool((decoded.values * torch.tensor(values) >= 0).all())  # a fit never flips a sign
    elif case.startswith("raw+int8"):  # each within its bucket's scale / 254, never a flipped sign
        bucket = sc.VALUE_CODECS.parse(CASES[case][1]).bucket
        scales = [max(abs(v) for v in values[i - i % bucket:i - i % bucket + bucket]) for i in range(len(values))]
        for got, want, scale in zip(decoded.values.tolist(), values, scales, strict=True):
            assert abs(got - want) <= scale / 254 + 1e-7 and got * want >= 0
    elif not case.startswith("raw+qsgd"):
        assert decoded.values.tolist() == values


if __name__ == "__main__" and "--update" in sys.argv:
    GOLDEN.write_text(json.dumps({k: encode_case(*v).hex() for k, v in sorted(CASES.items())}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
