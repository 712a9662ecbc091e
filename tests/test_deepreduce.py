"""DeepReduce (seed 000): the Bloom-filter index codec with its policies, and the curve-fit value
codecs with their reordering."""

import math
import zlib

import numpy as np
import pytest
import torch

import sparsecomm as sc
from helpers import random_sparse
from sparsecomm.bench.sources import make_gradient
from sparsecomm.encode.index.bloom_filter import BloomFilter, expected_fpr, filter_size
from sparsecomm.encode.index.bloom_policies import choose
from sparsecomm.presets import resolve
from sparsecomm.sparsify.topk import TopK


def bloom_positives(numel: int, count: int, fpr: float, seed: int) -> tuple[np.ndarray, np.ndarray, BloomFilter]:
    rng = np.random.default_rng(seed)
    true = np.sort(rng.choice(numel, size=count, replace=False))
    bits, hashes = filter_size(count, fpr)
    bloom = BloomFilter.build(true, bits, hashes, seed)
    return true, bloom.query(numel, limit=numel), bloom


# -- the filter --------------------------------------------------------------------------------
def test_filter_is_sized_as_in_remark_2():
    bits, hashes = filter_size(1000, 0.01)
    assert bits == math.ceil(-1000 * math.log(0.01) / math.log(2) ** 2) == 9586
    assert hashes == round(bits / 1000 * math.log(2)) == 7


def test_measured_false_positive_rate_is_close_to_the_target_over_many_seeds():
    numel, count = 200_000, 2_000
    for fpr in (0.1, 0.01, 0.001):
        rates = []
        for seed in range(20):
            true, positives, _ = bloom_positives(numel, count, fpr, seed)
            assert np.isin(true, positives).all()  # a Bloom filter has no false negatives
            rates.append((positives.size - count) / (numel - count))
        mean = float(np.mean(rates))
        # 20 × 198,000 trials: the standard error is well under 5% of the rate at every fpr here
        assert abs(mean / fpr - 1) < 0.15, (fpr, mean)


def test_positives_stay_within_lemma_5_on_average():
    numel, count, fpr = 100_000, 1_000, 0.01
    sizes = [bloom_positives(numel, count, fpr, seed)[1].size for seed in range(20)]
    bits, hashes = filter_size(count, fpr)
    bound = math.ceil(count + expected_fpr(count, bits, hashes) * (numel - count))  # Lemma 5: r + ε(d − r)
    spread = 3 * math.sqrt(fpr * numel / len(sizes))
    assert count <= min(sizes) and np.mean(sizes) <= bound + spread


def test_hashes_agree_for_the_same_seed_and_differ_across_seeds():
    indices = np.arange(0, 10_000, 7)
    a = BloomFilter.build(indices, 4096, 5, seed=11)
    assert np.array_equal(a.bits, BloomFilter.build(indices, 4096, 5, seed=11).bits)
    assert not np.array_equal(a.bits, BloomFilter.build(indices, 4096, 5, seed=12).bits)


# -- the policies -------------------------------------------------------------------------------
def topk_selection(numel=36_864, ratio=0.01, seed=0):
    dense = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return dense, TopK(ratio=ratio).sparsify(dense).sorted()


def test_p0_reconstructs_the_selection_exactly_and_false_positives_carry_true_values():
    dense, selection = topk_selection()
    decoded = sc.decode(sc.encode(selection, "bloom(policy=p0,fpr=0.01)", "fp32", dense=dense))
    assert decoded.nnz > selection.nnz  # false positives came along
    assert torch.equal(decoded.values, dense[decoded.indices])
    assert bool(torch.isin(selection.indices, decoded.indices).all())
    without_dense = sc.decode(sc.encode(selection, "bloom(policy=p0,fpr=0.01)", "fp32"))
    torch.testing.assert_close(without_dense.to_dense(), selection.to_dense(), rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["p1", "p2", "leftmost", "naive"])
def test_other_policies_send_exactly_r_values(policy):
    dense, selection = topk_selection()
    payload = sc.encode(selection, f"bloom(policy={policy},fpr=0.01)", "fp32", dense=dense)
    assert sc.read_info(payload).nnz == selection.nnz == sc.decode(payload).nnz
    assert not sc.read_info(payload).lossless


def test_p2_keeps_at_least_as_many_true_positives_as_p1_on_average():
    numel, count, fpr = 50_000, 500, 0.005  # about r/2 false positives
    kept = {"p1": [], "p2": []}
    for seed in range(20):
        true, positives, bloom = bloom_positives(numel, count, fpr, seed)
        for policy in kept:
            chosen = choose(policy, positives, bloom.positions(positives), count, np.random.default_rng(seed))
            assert chosen.size == count and np.array_equal(chosen, np.unique(chosen))
            kept[policy].append(np.isin(chosen, true).sum())
    assert np.mean(kept["p2"]) >= np.mean(kept["p1"])
    # P1 keeps r·r/|P| true ones on average; P2 prefers singleton conflict sets, which are true
    # positives (measured here: P1 334, P2 455 of 500)
    assert abs(np.mean(kept["p1"]) / (count * count / (count + fpr * (numel - count))) - 1) < 0.05
    assert np.mean(kept["p2"]) > 0.88 * count


def test_naive_policy_misaligns_values_after_the_first_false_positive():
    """The paper's warning, made concrete: naive sends the true values in order, but the receiver
    puts them on the first r positives; after the first false positive, every value shifts."""
    dense, selection = topk_selection()
    naive = sc.decode(sc.encode(selection, "bloom(policy=naive,fpr=0.05)", "fp32", dense=dense))
    leftmost = sc.decode(sc.encode(selection, "bloom(policy=leftmost,fpr=0.05)", "fp32", dense=dense))
    assert torch.equal(naive.indices, leftmost.indices)  # both keep the first r positives
    assert torch.equal(naive.values, selection.values)  # naive: the sender's values, in its order
    first_false = int(torch.nonzero(naive.indices != selection.indices[: naive.nnz])[0])
    assert torch.equal(naive.values[:first_false], dense[naive.indices[:first_false]])
    assert not torch.equal(naive.values[first_false:], dense[naive.indices[first_false:]])

    def error(grad):
        return float((grad.to_dense() - selection.to_dense()).norm() / selection.values.norm())

    assert error(naive) > 1.2 * error(leftmost)  # misaligned values cost more than dropped ones


def test_bloom_handles_empty_and_full_selections():
    empty = sc.SparseGradient(torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.Size([1000]))
    assert sc.decode(sc.encode(empty, "bloom(policy=p2)")).nnz == 0
    full = random_sparse(300, 300, seed=1)
    for policy in ("p0", "p2", "naive"):
        decoded = sc.decode(sc.encode(full, f"bloom(policy={policy})"))
        assert torch.equal(decoded.indices, torch.arange(300)) and torch.equal(decoded.values, full.sorted().values)


@pytest.mark.parametrize("policy", ["naive", "leftmost", "p0", "p1", "p2"])
@pytest.mark.parametrize("nnz", [1, 2, 4])
def test_a_selection_a_filter_cannot_carry_goes_exactly_in_the_same_payload(policy, nnz):
    # a tiny selection of a huge tensor: false positives would outnumber it thousands of times
    grad = random_sparse(2_000_000, nnz, seed=nnz)
    payload = sc.encode(grad, f"bloom(policy={policy},fpr=0.5)")
    decoded = sc.decode(payload, expect=2_000_000)
    assert torch.equal(decoded.indices, grad.sorted().indices)
    assert torch.equal(decoded.values, grad.sorted().values)
    assert len(payload) < 140  # the exact indices, not a filter of its false positives


def test_ranks_with_the_same_seed_send_the_same_bytes():
    grad = torch.randn(30_000, generator=torch.Generator().manual_seed(5))
    spec = "topk(ratio=0.01)+residual+bloom(policy=p2,fpr=0.01)+polyfit+allgather"
    payload = sc.Pipeline(spec, seed=7).compress(grad, "w")
    assert sc.Pipeline(spec, seed=7).compress(grad, "w") == payload
    assert sc.Pipeline(spec, seed=8).compress(grad, "w") != payload  # another filter seed


def test_pipeline_feedback_sees_what_bloom_receivers_decode():
    pipe = sc.Pipeline("topk(ratio=0.01)+residual+bloom(policy=p1,fpr=0.05)+fp32+allgather", seed=3)
    grad = torch.randn(20_000, generator=torch.Generator().manual_seed(4))
    received = sc.decode(pipe.compress(grad, "w"))
    residual = pipe.states["w"].feedback["residual"]
    torch.testing.assert_close(residual + received.to_dense(), grad)


# -- curve fitting ------------------------------------------------------------------------------
def smooth_values(count: int, seed: int = 0) -> torch.Tensor:
    """The top 1% of a Laplace gradient, in random order: sorted, they form smooth curves."""
    values = make_gradient("laplace", count * 100, seed)
    top = values[values.abs().argsort(descending=True)[:count]]
    return top[torch.randperm(count, generator=torch.Generator().manual_seed(seed))]


def relative_error(decoded: torch.Tensor, truth: torch.Tensor) -> float:
    return float((decoded - truth).norm() / truth.norm())


@pytest.mark.parametrize(("codec", "bound"), [("polyfit", 0.02), ("polyfit(degree=3,segments=4)", 0.02),
                                               ("dexp", 0.06)])
def test_curve_fits_have_bounded_error_on_smooth_inputs(codec, bound):
    for count in (50, 369, 5_000):
        values = smooth_values(count)
        grad = sc.SparseGradient(torch.arange(count) * 3, values, torch.Size([3 * count]))
        decoded = sc.decode(sc.encode(grad, "rice", codec))
        assert relative_error(decoded.values, values) < bound, (codec, count)
        assert bool((decoded.values * values >= 0).all())  # signs are never flipped


def test_reordering_maps_every_value_back_to_its_index():
    """Values that a polynomial fits exactly come back exactly, each at its own index."""
    count = 1000
    sorted_curve = torch.linspace(1.0, 2.0, count, dtype=torch.float64) ** 2  # degree 2: fitted exactly
    shuffle = torch.randperm(2 * count, generator=torch.Generator().manual_seed(0))
    values = torch.cat([sorted_curve, -sorted_curve])[shuffle]
    grad = sc.SparseGradient(torch.arange(2 * count) * 5, values, torch.Size([10 * count]))
    decoded = sc.decode(sc.encode(grad.to(torch.float32), "rice", "polyfit(degree=2,segments=1)"))
    torch.testing.assert_close(decoded.values, values.float(), rtol=1e-4, atol=1e-5)
    assert len(sc.encode(grad.to(torch.float32), "rice", "polyfit(degree=2,segments=1)")) < 2 * count * 2


def test_the_reordering_costs_ceil_log2_r_bits_per_value():
    values = smooth_values(369)
    grad = sc.SparseGradient(torch.arange(369), values, torch.Size([369]))
    info = sc.read_info(sc.encode(grad, "raw", "dexp"))
    model_bytes = 4 + 2 * (4 + 1 + 32)  # positive count; per part: length, kind, four float64
    assert info.value_bytes == model_bytes + math.ceil(369 * math.ceil(math.log2(369)) / 8)


def test_curve_fits_handle_tiny_and_one_signed_inputs():
    for values in ([], [2.5], [-1.0, -3.0], [1.0, 2.0, 3.0], [0.0, 0.0, 1.0]):
        grad = sc.SparseGradient(torch.arange(len(values), dtype=torch.int64), torch.tensor(values),
                                 torch.Size([10]))
        for codec in ("polyfit", "dexp"):
            decoded = sc.decode(sc.encode(grad, "raw", codec))
            torch.testing.assert_close(decoded.values, torch.tensor(values), rtol=1e-4, atol=1e-5)


def test_values_beyond_float32_models_are_refused_by_the_sender():
    grad = sc.SparseGradient(torch.tensor([0, 1]), torch.tensor([1e300, 2.0], dtype=torch.float64), torch.Size([2]))
    for codec in ("polyfit", "dexp"):
        with pytest.raises(sc.SparseCommError, match="overflows"):
            sc.encode(grad, "raw", codec)


def test_a_reordering_that_is_not_a_permutation_is_rejected():
    grad = sc.SparseGradient(torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.Size([4]))
    payload = bytearray(sc.encode(grad, "raw", "polyfit"))
    info = sc.read_info(bytes(payload))
    ranks_at = len(payload) - 4 - 1  # 4 ranks of 2 bits: the last byte before the CRC
    payload[ranks_at] = 0  # every value now claims rank 0
    body = bytes(payload[:-4])
    with pytest.raises(sc.PayloadError, match="not a permutation"):
        sc.decode(body + zlib.crc32(body).to_bytes(4, "little"))
    assert info.nnz == 4


def test_deepreduce_presets_train_through_a_pipeline():
    for preset in ("deepreduce", "deepreduce-qsgd"):
        pipe = sc.Pipeline(resolve(preset), seed=1)
        grad = torch.randn(40_000, generator=torch.Generator().manual_seed(2))
        decoded = sc.decode(pipe.compress(grad, "w"))
        assert decoded.nnz > 0 and relative_error(decoded.to_dense(), grad) < 1.0
