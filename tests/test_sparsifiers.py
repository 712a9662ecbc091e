"""Sparsifiers select what their papers say, report selected vs target, and use no global RNG."""

import math

import pytest
import torch

import sparsecomm as sc

SPARSIFIERS = ["topk(ratio=0.01)", "dgc(ratio=0.01)", "randomk(ratio=0.01)", "threshold(value=2.0)",
               "block_topk(ratio=0.01,block=32)", "bucketed_topk(k=2,bucket=64)", "nonzero"]


def make(text):
    return sc.SPARSIFIERS.parse(text)


def laplace(numel, seed):
    """Laplace(0, 1) draws: an exponential magnitude with a random sign."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (numel,), generator=generator) * 2 - 1
    return torch.empty(numel).exponential_(generator=generator) * signs


def test_topk_selects_exactly_the_largest_magnitudes():
    grad = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    selection = make("topk(k=50)").sparsify(grad)
    expected = set(torch.topk(grad.abs(), 50).indices.tolist())
    assert set(selection.indices.tolist()) == expected
    assert torch.equal(selection.values, grad[selection.indices])


def test_ratio_rounds_up_and_never_selects_nothing():
    assert make("topk(ratio=0.001)").target_count(10) == 1
    assert make("topk(ratio=0.25)").target_count(10) == 3
    assert make("topk(k=50)").target_count(10) == 10


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("source", ["normal", "laplace"])
def test_dgc_sampled_threshold_lands_within_30_percent_of_k(seed, source):
    numel = 1_000_000
    if source == "normal":
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    else:
        grad = laplace(numel, seed)
    sparsifier = make("dgc(ratio=0.001)")
    selection = sparsifier.sparsify(grad, torch.Generator().manual_seed(seed))
    k = sparsifier.target_count(numel)
    assert 0.7 * k <= selection.nnz <= 1.3 * k
    # whatever it picked, it picked the largest: nothing left out is larger than anything selected
    left_out = torch.ones(numel, dtype=torch.bool)
    left_out[selection.indices] = False
    assert float(grad[left_out].abs().max()) <= float(selection.values.abs().min())


def test_dgc_refines_with_an_exact_topk_when_the_sample_overshoots():
    grad = torch.zeros(100_000)
    grad[::10] = 1.0  # 10,000 ties: every sampled magnitude is the threshold
    grad[5] = 5.0
    selection = make("dgc(k=100,sample=0.1)").sparsify(grad)
    assert selection.nnz == 100 and 5 in selection.indices.tolist()


def test_dgc_lowers_the_threshold_when_the_sample_undershoots():
    grad = torch.zeros(100_000)
    grad[1::100] = torch.linspace(1.0, 2.0, 1000)  # a strided sample from offset 0 sees only zeros
    selection = make("dgc(k=1000,sample=0.01)").sparsify(grad)  # no generator: start at 0
    assert selection.nnz == 1000


def test_randomk_is_uniform_and_reproducible_from_the_generator(global_rng_untouched):
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    sparsifier = make("randomk(k=100)")
    first = sparsifier.sparsify(grad, torch.Generator().manual_seed(7)).indices
    again = sparsifier.sparsify(grad, torch.Generator().manual_seed(7)).indices
    other = sparsifier.sparsify(grad, torch.Generator().manual_seed(8)).indices
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.unique().numel() == 100
    counts = torch.zeros(1000)
    generator = torch.Generator().manual_seed(0)
    for _ in range(400):
        counts[sparsifier.sparsify(grad, generator).indices] += 1
    expected = 400 * 100 / 1000  # 40 per position; binomial std ≈ 6
    assert abs(float(counts.mean()) - expected) < 1e-6
    assert float(counts.std()) < 1.5 * math.sqrt(400 * 0.1 * 0.9)


def test_threshold_keeps_everything_at_or_above_it():
    grad = torch.tensor([0.5, -2.0, 2.0, 1.999, -3.0])
    assert sorted(make("threshold(value=2.0)").sparsify(grad).indices.tolist()) == [1, 2, 4]


def test_block_topk_keeps_whole_blocks_of_largest_norm():
    grad = torch.zeros(100)
    grad[40:50] = 1.0  # block 4 (norm √10)
    grad[95] = 2.5  # block 9, the short tail block (norm 2.5)
    grad[0] = 3.0  # block 0 (norm 3)
    selection = make("block_topk(k=2,block=10)").sparsify(grad)
    assert sorted(selection.indices.tolist()) == list(range(0, 10)) + list(range(40, 50))
    tail = make("block_topk(k=3,block=10)").sparsify(grad)
    assert sorted(tail.indices.tolist())[-5:] == [95, 96, 97, 98, 99] and tail.nnz == 30


def test_bucketed_topk_takes_k_from_every_bucket_including_the_tail():
    grad = torch.randn(64 * 3 + 5, generator=torch.Generator().manual_seed(1))
    sparsifier = make("bucketed_topk(k=2,bucket=64)")
    selection = sparsifier.sparsify(grad)
    assert selection.nnz == sparsifier.target_count(grad.numel()) == 8
    buckets = selection.indices // 64
    assert torch.bincount(buckets).tolist() == [2, 2, 2, 2]
    for b in range(4):
        chunk = grad[64 * b : 64 * (b + 1)]
        expected = torch.topk(chunk.abs(), 2).indices + 64 * b
        assert set(selection.indices[buckets == b].tolist()) == set(expected.tolist())


@pytest.mark.parametrize("text", SPARSIFIERS)
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 1), (1000,)])
def test_tiny_and_empty_tensors(text, shape, global_rng_untouched):
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 5
    selection = make(text).sparsify(grad, torch.Generator().manual_seed(0))
    selection.validate()
    assert selection.shape == grad.shape and selection.nnz <= grad.numel()
    assert torch.equal(selection.values, grad.reshape(-1)[selection.indices])


@pytest.mark.parametrize("text", SPARSIFIERS)
def test_multi_dimensional_gradients_use_flat_indices(text):
    grad = torch.randn(20, 30, generator=torch.Generator().manual_seed(4)) * 3
    selection = make(text).sparsify(grad, torch.Generator().manual_seed(0))
    assert selection.shape == (20, 30)
    assert torch.equal(selection.values, grad.reshape(-1)[selection.indices])


COUNTED = [name for name in sc.SPARSIFIERS.names()
           if issubclass(sc.SPARSIFIERS.get(name), sc.components.CountedSparsifier)]


def test_every_count_based_sparsifier_shares_one_base():
    assert set(COUNTED) >= {"topk", "dgc", "randomk", "block_topk", "bucketed_topk"}


@pytest.mark.parametrize("name", COUNTED)
@pytest.mark.parametrize("params", ["", "ratio=0.1,k=3", "ratio=0", "ratio=1.5", "k=-1", "k=3,warmup=2",
                                    "ratio=0.1,warmup=-1"])
def test_count_parameters_are_checked_alike(name, params):
    with pytest.raises(sc.SpecError, match=name):
        make(f"{name}({params})")


@pytest.mark.parametrize("name", COUNTED)
def test_warmup_schedules_every_count_based_sparsifier(name):
    sparsifier = make(f"{name}(ratio=0.001,warmup=8)")
    assert [sparsifier.at_step(step).ratio for step in (0, 2, 4, 6, 8)] == [0.25, 0.0625, 0.015625, 0.00390625,
                                                                             0.001]
    assert sparsifier.at_step(0).warmup == 0
    grad = torch.randn(65536, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    assert sparsifier.at_step(0).sparsify(grad, generator).nnz > 8 * sparsifier.at_step(8).sparsify(grad, generator).nnz


def test_the_host_and_device_samples_of_dgc_begin_at_the_same_draw_and_inside_the_tensor():
    from sparsecomm.sparsify.dgc_threshold import device_sampled_threshold, sample_start, sampled_threshold

    flat = torch.randn(5, generator=torch.Generator().manual_seed(0))
    for seed in range(20):  # a stride longer than the tensor: the start stays inside it
        start = int(sample_start(flat.numel(), 1000, torch.Generator().manual_seed(seed), flat.device))
        assert 0 <= start < flat.numel()
        threshold = device_sampled_threshold(flat, 1, 1000, torch.Generator().manual_seed(seed))
        assert float(threshold) == float(flat[start].abs())
    big = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    host = sampled_threshold(big, 100, 0.01, torch.Generator().manual_seed(3))
    device_path = device_sampled_threshold(big, 100, 100, torch.Generator().manual_seed(3))  # torch's ops, on the CPU
    assert host == float(device_path)


@pytest.mark.parametrize("spec", ["adaptive(density=0.01)", "dgc(ratio=0.01)"])
def test_where_fewer_than_k_entries_are_nonzero_only_those_are_kept(spec):
    """A zero sends nothing: 100 nonzero entries of 200,000 at a target of 2,000 keep 100."""
    sparsifier = sc.parse_spec(spec).sparsifier
    flat = torch.zeros(200_000)
    flat[::2000] = torch.linspace(1, 2, 100)
    selection = sparsifier.sparsify(flat, torch.Generator().manual_seed(0))
    assert selection.nnz == 100 and bool((selection.values != 0).all())


def test_ties_at_the_kth_magnitude_are_kept_in_index_order_up_to_k():
    from sparsecomm.sparsify.dgc_threshold import refined_selection

    flat = torch.tensor([1.0, 3.0, 1.0, 0.0, -1.0, 2.0, 1.0, 0.0])
    kept = refined_selection(flat, 4, 0.0, lower=1.0, upper=1.0, decay=0.5, retries=0, in_order=True)
    assert kept.tolist() == [0, 1, 2, 5]  # 3 and 2, then the first two of the four 1s
