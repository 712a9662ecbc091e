"""SKCompress (seed 003, design notes §2): quantile buckets, grouped MinMaxSketch, delta-binary keys,
Huffman or ANS — keys and values in one payload section."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsecomm as sc
from helpers import random_sparse
from sparsecomm.bench.sources import make_gradient
from sparsecomm.encode.joint.skcompress import group_bounds, negative_bin_count, quantile_splits
from sparsecomm.presets import resolve
from sparsecomm.sparsify.topk import TopK


def top_selection(source="laplace", numel=200_000, ratio=0.01, seed=0) -> sc.SparseGradient:
    return TopK(ratio=ratio).sparsify(make_gradient(source, numel, seed)).sorted()


CODECS = ["skcompress", "skcompress(coder=ans)", "skcompress(bins=16,groups=2)", "skcompress(rows=1,columns=2.0)",
          "skcompress(keys=rice,coder=ans)"]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("source", ["normal", "laplace", "mlp"])
def test_keys_exact_signs_kept_and_magnitudes_never_beyond_the_true_bin(codec, source):
    selection = top_selection(source)
    decoded = sc.decode(sc.encode(selection, codec))
    assert torch.equal(decoded.indices, selection.indices)
    truth = selection.values.numpy()
    got = decoded.values.numpy()
    assert (np.sign(got) == np.sign(truth)).all()
    bins = sc.parse_spec(codec).index_codec.bins
    splits = quantile_splits(truth, bins)
    true_bin = np.clip(np.searchsorted(splits, truth.astype(np.float32), side="right") - 1, 0, splits.size - 2)
    bin_magnitude = np.maximum(np.abs(splits[true_bin]), np.abs(splits[true_bin + 1]))
    assert (np.abs(got) <= bin_magnitude * (1 + 1e-6)).all()


def test_without_collisions_every_value_decodes_to_its_bin_midpoint():
    selection = top_selection()
    decoded = sc.decode(sc.encode(selection, "skcompress(columns=2.0,rows=4)"))
    splits = quantile_splits(selection.values.numpy(), 256)
    value_bin = np.clip(np.searchsorted(splits, selection.values.numpy(), side="right") - 1, 0, splits.size - 2)
    midpoint = (splits[value_bin].astype(np.float64) + splits[value_bin + 1]) / 2
    collided = np.abs(decoded.values.numpy() - midpoint) > 1e-6 * np.abs(midpoint)
    assert collided.mean() < 0.01  # 8 cells per key (the most allowed): collisions all but vanish


@pytest.mark.parametrize("source", ["laplace", "mlp"])
def test_more_groups_shrink_values_less_for_about_the_same_bytes(source):
    """A collision shrinks a value to the bin of its group nearest zero: the `skcompress` preset's
    128 groups of two bins bound that by a narrower span than SketchML's 8 groups of 32, for a
    group table of 1 kB and keys restarting in more lists (the size of lm's output layer here)."""
    selection = top_selection(source, numel=1_280_000)
    error, size = {}, {}
    for groups in (8, 128):
        payload = sc.encode(selection, f"skcompress(groups={groups})", rng=np.random.default_rng(0))
        error[groups] = float((sc.decode(payload).values - selection.values).norm() / selection.values.norm())
        size[groups] = len(payload)
    assert error[128] < error[8] / 2
    assert size[128] < 1.25 * size[8]


def test_groups_never_straddle_zero():
    for bins, negative, groups in [(256, 100, 8), (10, 1, 8), (10, 9, 8), (5, 0, 8), (5, 5, 8), (3, 2, 2)]:
        edges = group_bounds(bins, negative, groups)
        assert edges[0] == 0 and edges[-1] == bins and (np.diff(edges) > 0).all()
        assert len(edges) - 1 <= groups
        assert negative in edges or negative in (0, bins)


def test_zero_is_a_split_when_values_have_both_signs():
    splits = quantile_splits(np.array([-3.0, -1.0, 2.0, 5.0], dtype=np.float32), 2)
    assert 0.0 in splits and splits[negative_bin_count(splits)] == 0.0


def test_the_same_seed_gives_the_same_bytes():
    selection = top_selection()
    first = sc.encode(selection, "skcompress", rng=np.random.default_rng(5))
    assert first == sc.encode(selection, "skcompress", rng=np.random.default_rng(5))
    assert first != sc.encode(selection, "skcompress", rng=np.random.default_rng(6))  # another hash seed


def test_ans_is_smaller_than_huffman_on_the_same_input():
    # ANS sends a larger frequency table (u16 per symbol, 4-byte words): it pays off from about
    # 10,000 nonzeros on (measured: 1-2% smaller there; 0.3% larger at 2,000)
    sizes = {coder: [] for coder in ("huffman", "ans")}
    for source in ("normal", "laplace", "mlp"):
        selection = top_selection(source, numel=1_000_000)
        for coder in sizes:
            sizes[coder].append(len(sc.encode(selection, f"skcompress(coder={coder})")))
    assert sum(sizes["ans"]) < sum(sizes["huffman"])


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 3000), data=st.data())
def test_awkward_inputs_round_trip_their_keys(numel, data):
    nnz = data.draw(st.sampled_from([0, 1, 2, min(3, numel), numel, data.draw(st.integers(0, numel))]))
    grad = random_sparse(numel, min(nnz, numel), seed=data.draw(st.integers(0, 2**31)))
    if data.draw(st.booleans()) and grad.nnz:  # one sign only, or all equal
        grad = sc.SparseGradient(grad.indices, grad.values.abs() if data.draw(st.booleans()) else
                                 torch.full_like(grad.values, -0.5), grad.shape)
    codec = data.draw(st.sampled_from(CODECS))
    decoded = sc.decode(sc.encode(grad, codec))
    assert torch.equal(decoded.indices, grad.sorted().indices)
    assert bool((decoded.values * grad.sorted().values >= 0).all())


def test_skcompress_codes_values_itself():
    with pytest.raises(sc.SpecError, match="codes the values itself"):
        sc.parse_spec("topk(ratio=0.01)+skcompress+qsgd")
    with pytest.raises(sc.SparseCommError, match="codes the values itself"):
        sc.encode(top_selection(), "skcompress", "fp16")
    with pytest.raises(sc.SpecError, match="needs a transport that sends payloads"):
        sc.parse_spec("topk(ratio=0.01)+skcompress+sparse_allreduce")
    huge = sc.SparseGradient(torch.tensor([0, 1]), torch.tensor([1e300, -1.0], dtype=torch.float64), torch.Size([2]))
    with pytest.raises(sc.SparseCommError, match="overflows float32"):
        sc.encode(huge, "skcompress")
    info = sc.read_info(sc.encode(top_selection(), "skcompress"))
    assert info.value_bytes == 0 and not info.lossless


def test_the_preset_runs_with_error_feedback():
    pipe = sc.Pipeline(resolve("skcompress"), seed=2)
    grad = make_gradient("laplace", 50_000, 1)
    received = sc.decode(pipe.compress(grad, "w"))
    torch.testing.assert_close(pipe.states["w"].feedback["residual"] + received.to_dense(), grad)


def test_rice_keys_take_fewer_bits_than_byte_deltas():
    selection = top_selection(numel=1_000_000)
    sizes = {keys: len(sc.encode(selection, f"skcompress(keys={keys})")) for keys in ("bytes", "rice")}
    assert sizes["rice"] < 0.95 * sizes["bytes"]


@pytest.mark.parametrize("bad", [{"bins": 0}, {"groups": 1}, {"rows": 0}, {"columns": 0.0}, {"coder": "zip"},
                                 {"keys": "varint"}])
def test_bad_parameters_are_clear_errors(bad):
    with pytest.raises(sc.SparseCommError, match="skcompress"):
        sc.INDEX_CODECS.create("skcompress", bad)
