"""Every index codec and every value codec round-trips through a payload, for every awkward case:
sizes 0, 1, small and large; density 0, tiny and 1.0; fp32/fp16/bf16; unsorted input indices."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparsecomm as sc
from helpers import FLOAT_DTYPES, random_sparse
from sparsecomm.payload import as_tensor

INDEX_CODECS = ["raw", "raw(bits=64)", "packed", "bitmap", "rle", "delta_binary", "huffman", "rice",
                "rice(parameter=0)"]
LOSSLESS_VALUES = ["fp32", "deflate", "deflate(shuffle=false,level=1)", "zstd"]
ALL_VALUES = LOSSLESS_VALUES + ["fp16", "bf16", "qsgd", "qsgd(bits=2,bucket=3)"]

numels = st.one_of(st.sampled_from([0, 1, 2, 7, 64, 65536, 70_001]), st.integers(1, 5000))


@st.composite
def sparse_cases(draw):
    numel = draw(numels)
    density = draw(st.sampled_from(["zero", "one", "tiny", "full", "random"]))
    nnz = {"zero": 0, "one": min(1, numel), "tiny": min(numel, 3), "full": numel,
           "random": draw(st.integers(0, numel))}[density]
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    return random_sparse(numel, nnz, seed, dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grad=sparse_cases(), index_codec=st.sampled_from(INDEX_CODECS), value_codec=st.sampled_from(LOSSLESS_VALUES))
def test_lossless_pairs_recover_every_index_and_value_exactly(grad, index_codec, value_codec):
    decoded = sc.decode(sc.encode(grad, index_codec, value_codec))
    expected = grad.sorted()
    assert decoded.shape == grad.shape and decoded.dtype == grad.dtype
    assert torch.equal(decoded.indices, expected.indices)
    assert torch.equal(decoded.values, expected.values)


@settings(max_examples=40, deadline=None)
@given(grad=sparse_cases(), value_codec=st.sampled_from(["fp16", "bf16"]))
def test_float_casts_decode_to_the_cast_value(grad, value_codec):
    wire = torch.float16 if value_codec == "fp16" else torch.bfloat16
    decoded = sc.decode(sc.encode(grad, "rice", value_codec))
    assert torch.equal(decoded.values, grad.sorted().values.to(wire).to(grad.dtype))


@pytest.mark.parametrize("index_codec", INDEX_CODECS)
@pytest.mark.parametrize("value_codec", ALL_VALUES)
def test_every_pair_on_a_large_tensor(index_codec, value_codec):
    grad = random_sparse(300_000, 2_000, seed=1, shape=(600, 500))
    decoded = sc.decode(sc.encode(grad, index_codec, value_codec))
    assert torch.equal(decoded.indices, grad.sorted().indices)
    assert decoded.shape == (600, 500)
    if value_codec in LOSSLESS_VALUES:
        assert torch.equal(decoded.values, grad.sorted().values)


def test_long_gaps_use_escapes_and_wide_deltas():
    numel = 3 * 2**32 + 11
    indices = torch.tensor([0, 65534, 65535 + 65534 + 1, 2**32 + 5, numel - 1])
    grad = sc.SparseGradient(indices, torch.arange(1.0, 6.0), torch.Size([numel]))
    for codec in ["raw(bits=64)", "rle", "delta_binary", "huffman", "rice"]:
        assert torch.equal(sc.decode(sc.encode(grad, codec)).indices, indices), codec


def test_raw32_refuses_tensors_it_cannot_address():
    grad = sc.SparseGradient(torch.tensor([2**31 + 5]), torch.ones(1), torch.Size([2**31 + 10]))
    with pytest.raises(sc.SparseCommError, match="raw\\(bits=64\\)"):
        sc.encode(grad, "raw")


def test_packed_indices_refuse_tensors_beyond_32_bits_and_read_any_width_up_to_them():
    grad = sc.SparseGradient(torch.tensor([2**32 + 5]), torch.ones(1), torch.Size([2**32 + 10]))
    with pytest.raises(sc.SparseCommError, match="2\\*\\*32"):
        sc.encode(grad, "packed")
    indices = torch.tensor([0, 1, 2**31 + 7, 2**32 - 1])
    grad = sc.SparseGradient(indices, torch.ones(4), torch.Size([2**32]))
    payload = sc.encode(grad, "packed")
    assert torch.equal(sc.decode(payload).indices, indices)
    assert sc.read_info(payload).index_bytes == 17  # two blocks: two 3-bit counts and four 31-bit offsets


def test_unsorted_indices_are_sorted_with_their_values():
    grad = sc.SparseGradient(torch.tensor([9, 2, 5]), torch.tensor([0.9, 0.2, 0.5]), torch.Size([10]))
    decoded = sc.decode(sc.encode(grad, "rice", "fp32"))
    assert decoded.indices.tolist() == [2, 5, 9]
    assert decoded.values.tolist() == pytest.approx([0.2, 0.5, 0.9])


def test_duplicate_indices_are_rejected_clearly():
    grad = sc.SparseGradient(torch.tensor([4, 1, 4]), torch.ones(3), torch.Size([10]))
    with pytest.raises(sc.SparseCommError, match="duplicate index 4"):
        sc.encode(grad, "rice")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_rejected(bad):
    grad = sc.SparseGradient(torch.tensor([1, 3]), torch.tensor([1.0, bad]), torch.Size([4]))
    with pytest.raises(sc.SparseCommError, match="non-finite value .* at index 3"):
        sc.encode(grad)


def test_fp16_overflow_is_an_error_not_an_infinity():
    grad = sc.SparseGradient(torch.tensor([0]), torch.tensor([1e6]), torch.Size([1]))
    with pytest.raises(sc.SparseCommError, match="overflows fp16"):
        sc.encode(grad, "raw", "fp16")


def test_qsgd_is_unbiased_over_seeds():
    grad = random_sparse(5000, 1000, seed=3)
    bucket, draws = 64, 400
    trials = torch.stack([
        sc.decode(sc.encode(grad, "raw", f"qsgd(bits=2,bucket={bucket})", rng=np.random.default_rng(s))).values
        for s in range(draws)
    ])
    truth = grad.sorted().values
    norms = torch.nn.functional.pad(truth, (0, -len(truth) % bucket)).reshape(-1, bucket).norm(dim=1)
    norm = norms.repeat_interleave(bucket)[: len(truth)]
    p = truth.abs() / norm  # s = 1 level: the value is norm·Bernoulli(p)·sign
    std_of_mean = norm * torch.sqrt(p * (1 - p)) / draws**0.5
    z = (trials.mean(0) - truth) / std_of_mean
    assert abs(float(z.mean())) < 0.2  # 1000 values: the mean of z has std ≈ 0.03 when unbiased
    assert float(z.abs().mean()) < 1.0  # E|z| ≈ 0.8 for a standard normal
    assert not torch.equal(trials[0], trials[1])  # it really is stochastic


@pytest.mark.parametrize(("bits", "bucket"), [(2, 1), (3, 7), (4, 256), (8, 512), (12, 100), (16, 70_000)])
def test_qsgd_error_is_bounded_by_one_level_of_the_bucket_norm(bits, bucket):
    grad = random_sparse(200_000, 80_000, seed=4)
    decoded = sc.decode(sc.encode(grad, "raw", f"qsgd(bits={bits},bucket={bucket})")).values
    truth = grad.sorted().values
    norms = torch.nn.functional.pad(truth, (0, -len(truth) % bucket)).reshape(-1, bucket).norm(dim=1)
    level = norms.repeat_interleave(bucket)[: len(truth)] / (2 ** (bits - 1) - 1)
    assert bool(((decoded - truth).abs() <= level * 1.0001).all())
    assert bool((torch.sign(decoded) * torch.sign(truth) >= 0).all())  # never flips a sign


def test_same_rng_seed_gives_same_bytes():
    grad = random_sparse(1000, 100, seed=5)
    one = sc.encode(grad, "rice", "qsgd(bits=4)", rng=np.random.default_rng(11))
    two = sc.encode(grad, "rice", "qsgd(bits=4)", rng=np.random.default_rng(11))
    assert one == two


def test_a_calls_generator_takes_a_negative_seed_as_any_other():
    """Seeds are any integer (the reducer's, a sketch's): the stochastic codecs' generator too."""
    from sparsecomm.transport.request import Request

    draws = [Request(key="w", seed=seed, step=3).rng(1).random() for seed in (-1, 1, -1)]
    assert draws[0] == draws[2] != draws[1]


def test_payload_as_uint8_tensor_decodes_too():
    grad = random_sparse(100, 10, seed=6)
    payload = sc.encode(grad, "huffman", "fp16")
    tensor = as_tensor(payload)
    assert tensor.dtype == torch.uint8 and tensor.numel() == len(payload)
    assert torch.equal(sc.decode(tensor).indices, sc.decode(payload).indices)


def test_read_info_describes_the_payload():
    grad = random_sparse(4096, 40, seed=7, shape=(64, 64))
    info = sc.read_info(sc.encode(grad, "rice", "qsgd(bits=4)"))
    assert (info.numel, info.nnz, info.shape, info.dtype) == (4096, 40, (64, 64), torch.float32)
    assert (info.index_codec, info.value_codec, info.lossless) == ("rice", "qsgd(bits=4)", False)
