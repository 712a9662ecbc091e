"""Every registered codec — every Bloom policy too — with every value codec, at the edges: no
selection, one element, a few, every index, a tensor of one element, and a large tensor sent
whole. The encoder never emits a payload its decoder refuses, and each codec keeps the promise it
declares (lossless indices and values exact, casts exact to the wire type, lossy values finite and
never of the wrong sign). The codec list comes from the registries, so a new codec is tested here
the day it is registered."""

import warnings

import numpy as np
import pytest
import torch

import sparsecomm as sc
from helpers import random_sparse
from sparsecomm.fuzz import codec_pairs

PAIRS = codec_pairs()  # the fuzzer's seed pairs: every registered codec, every Bloom policy
SELECTIONS = {"empty": (1000, 0), "one": (1000, 1), "few": (1000, 3), "all": (1000, 1000), "numel 1": (1, 1),
              "numel 1, empty": (1, 0), "tiny of a million": (1 << 20, 2)}
LARGE = {"large, all": (200_000, 200_000)}
"""a large tensor sent whole: a second or more per pair for the curve fits and Bloom filters (``slow``)"""


@pytest.mark.parametrize(("index_codec", "value_codec"), PAIRS)
def test_every_pair_round_trips_at_the_edges(index_codec, value_codec):
    for case, (numel, nnz) in SELECTIONS.items():
        round_trips(index_codec, value_codec, case, numel, nnz)


@pytest.mark.slow
@pytest.mark.parametrize(("index_codec", "value_codec"), PAIRS)
def test_every_pair_round_trips_a_large_tensor_sent_whole(index_codec, value_codec):
    for case, (numel, nnz) in LARGE.items():
        round_trips(index_codec, value_codec, case, numel, nnz)


def round_trips(index_codec: str, value_codec: str, case: str, numel: int, nnz: int) -> None:
    """The pair's payload of a random selection of ``nnz`` of ``numel`` decodes as the codecs promise."""
    index, value = sc.INDEX_CODECS.parse(index_codec), sc.VALUE_CODECS.parse(value_codec)
    misaligned = index_codec == "bloom(policy=naive)"  # the paper's warning: values land on other indices
    grad = random_sparse(numel, nnz, seed=numel + nnz)
    dense = grad.to_dense()
    payload = sc.encode(grad, index, value, rng=np.random.default_rng(3), dense=dense)
    decoded = sc.decode(payload, expect=numel)
    where = f"{index_codec}+{value_codec}, {case}"
    truth = grad.sorted()
    if index.lossless:
        assert torch.equal(decoded.indices, truth.indices), where
    elif index.name == "bloom" and index.policy == "p0":  # every true index, plus false positives
        assert bool(torch.isin(truth.indices, decoded.indices).all()), where
    else:  # as many indices as were selected, each inside the tensor
        assert decoded.nnz == nnz and bool(((decoded.indices >= 0) & (decoded.indices < numel)).all()), where
    assert decoded.values.dtype == grad.dtype and bool(torch.isfinite(decoded.values).all()), where
    expected = dense.reshape(-1)[decoded.indices]  # what a receiver should see at the decoded indices
    if index.codes_values:
        assert bool((decoded.values * expected >= 0).all()), where
    elif value.lossless and not misaligned:
        assert torch.equal(decoded.values, expected), where
    elif value.name in ("fp16", "bf16"):
        wire = torch.float16 if value.name == "fp16" else torch.bfloat16
        if index.lossless:
            assert torch.equal(decoded.values, expected.to(wire).to(grad.dtype)), where
    elif index.lossless:  # qsgd and the curve fits never flip a sign
        assert bool((decoded.values * expected >= 0).all()), where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("index_codec", "value_codec"), PAIRS)
def test_exact_codecs_carry_every_value_of_the_gradients_dtype(index_codec, value_codec, dtype):
    from sparsecomm.encode.base import codecs_lossless
    from sparsecomm.encode.exact import exact_codecs

    given = sc.INDEX_CODECS.parse(index_codec), sc.VALUE_CODECS.parse(value_codec)
    index, value = exact_codecs(*given, dtype)
    if codecs_lossless(*given, dtype):
        assert (index, value) == given  # the pipeline's own, where they are already exact
    grad = random_sparse(5000, 300, seed=1).sorted()  # decoding gives indices ascending
    grad = type(grad)(grad.indices, (grad.values * 10.0 ** -torch.arange(300).remainder(7)).to(dtype), grad.shape)
    decoded = sc.decode(sc.encode(grad, index, value, rng=np.random.default_rng(0)), expect=5000)
    assert torch.equal(decoded.indices, grad.indices)
    assert decoded.values.dtype == dtype and torch.equal(decoded.values, grad.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_raw_codecs_carry_every_value_exactly_with_indices_as_wide_as_the_gradient_needs(dtype):
    from sparsecomm.encode.exact import raw_codecs

    assert raw_codecs(dtype, 2**31)[0].bits == 32 and raw_codecs(dtype, 2**31 + 1)[0].bits == 64
    index, value = raw_codecs(dtype, 5000)
    grad = random_sparse(5000, 300, seed=2).sorted()
    grad = type(grad)(grad.indices, (grad.values * 10.0 ** -torch.arange(300).remainder(7)).to(dtype), grad.shape)
    decoded = sc.decode(sc.encode(grad, index, value, rng=np.random.default_rng(0)), expect=5000)
    assert torch.equal(decoded.indices, grad.indices)
    assert decoded.values.dtype == dtype and torch.equal(decoded.values, grad.values)


MAGNITUDES = {"subnormal": [1e-40, -5e-41, 3e-42, -1e-45], "largest float32": [3.4028235e38, -3.0e38, 1.0, -2.5e37],
              "subnormal beside huge": [1e-40, 1e30, -2e-45, 7.0], "beyond float32": [1e300, -2.0, 3e-320, 5.0]}


@pytest.mark.parametrize("value_codec", sorted({value for _, value in PAIRS}))
@pytest.mark.parametrize("case", MAGNITUDES)
def test_value_codecs_at_float32s_extremes_decode_what_the_feedback_expects_or_refuse(value_codec, case):
    """Subnormal scales (127 / scale overflows), scales near float32's largest (a level times
    scale / 127 rounds past it) and float64 values beyond float32's range must neither turn into
    Inf or NaN on either side nor make the error feedback's idea of what was received differ from
    what a receiver decodes. A codec that cannot carry such values (fp16's range, a curve fit's or
    a quantizer's float32) may refuse them, clearly."""
    codec = sc.VALUE_CODECS.parse(value_codec)
    values = torch.tensor(MAGNITUDES[case] * 64, dtype=torch.float64 if case == "beyond float32" else torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow inside numpy is a finding, as in the fuzzer
        try:
            payload = sc.encode(sc.SparseGradient(torch.arange(values.numel()), values, torch.Size([values.numel()])),
                                sc.INDEX_CODECS.parse("raw"), codec, rng=np.random.default_rng(0))
        except sc.SparseCommError as refused:
            assert "overflows" in str(refused) and case != "subnormal"
            return
        decoded = sc.decode(payload, expect=values.numel()).values
        expected = codec.as_decoded(values)  # None: the feedback decodes the payload itself
    assert bool(torch.isfinite(decoded).all()), "a finite gradient decoded to Inf or NaN"
    assert bool((decoded * values >= 0).all()), "a flipped sign"
    if expected is not None:
        assert torch.equal(decoded, expected)


NEAR_THE_TOP = {torch.float16: [65504.0, 30000.0, -65504.0, 60000.0], torch.bfloat16: [3.3895e38, 2.5e37, -3.3e38, 1.0]}


@pytest.mark.parametrize("dtype", NEAR_THE_TOP)
@pytest.mark.parametrize("value_codec", sorted({value for _, value in PAIRS}))
def test_half_precision_values_near_their_largest_decode_within_their_range(value_codec, dtype):
    """A lossy codec's rebuilt value may pass the gradient dtype's largest by its error (QSGD's
    norm times a level, a fitted curve, bf16's rounding of 65504 up): the payload still decodes,
    at the dtype's bound, and the feedback's idea of what arrived is what a receiver decodes."""
    codec = sc.VALUE_CODECS.parse(value_codec)
    values = torch.tensor(NEAR_THE_TOP[dtype] * 16, dtype=dtype)
    grad = sc.SparseGradient(torch.arange(values.numel()), values, torch.Size([values.numel()]))
    for seed in range(8):
        try:
            payload = sc.encode(grad, sc.INDEX_CODECS.parse("raw"), codec, rng=np.random.default_rng(seed))
        except sc.SparseCommError as refused:
            assert "overflows" in str(refused), refused
            return
        decoded = sc.decode(payload, expect=values.numel()).values
        assert decoded.dtype == dtype and bool(torch.isfinite(decoded).all())
        expected = codec.as_decoded(values)
        if expected is not None:
            assert torch.equal(decoded, expected)


@pytest.mark.parametrize("scale", [1e-20, 1e-25, 1e-30, 1e-36])
def test_qsgd_carries_tiny_values_within_a_level_of_them(scale):
    """float32 squares of entries below about 1e-19 underflow: the bucket's norm must not."""
    values = torch.tensor([3.0, -2.0, 1.0, 0.5] * 8) * scale
    grad = sc.SparseGradient(torch.arange(values.numel()), values, torch.Size([values.numel()]))
    codec = sc.VALUE_CODECS.parse("qsgd(bits=8,bucket=16)")
    decoded = sc.decode(sc.encode(grad, "raw", codec, rng=np.random.default_rng(0))).values
    level = torch.linalg.vector_norm(values[:16].double()) / 127  # one level of the bucket
    assert bool(((decoded.double() - values.double()).abs() <= level * 1.001).all()), (decoded, values)


def test_a_payloads_lossless_flag_follows_the_gradients_dtype():
    grad = sc.SparseGradient(torch.tensor([1, 4]), torch.tensor([0.1, 1 / 3], dtype=torch.float64), torch.Size([8]))
    assert not sc.read_info(sc.encode(grad, "raw", "fp32")).lossless  # float64 rounded to float32
    half = sc.SparseGradient(grad.indices, grad.values.half(), grad.shape)
    assert sc.read_info(sc.encode(half, "raw", "fp16")).lossless  # float16 carried as it is
