"""The device path's stages on their own: which pipelines it runs, the fixed-size selection, the
feedback's propose/commit against the host feedback, and the fixed-size wire."""

import pytest
import torch

from sparsecomm.device.feedback import buffer_names, commit, propose
from sparsecomm.device.layout import BucketLayout
from sparsecomm.device.selection import select
from sparsecomm.device.support import device_native
from sparsecomm.device.wire import pack, unpack_sum, words
from sparsecomm.feedback.dgc_momentum import DGCMomentum
from sparsecomm.feedback.residual import Residual
from sparsecomm.pipeline import Segment
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.spec import parse_spec

DEVICE_SPEC = "dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+raw+fp32+allgather"


@pytest.mark.parametrize(("spec", "why"), [
    (DEVICE_SPEC, None),
    ("dgc(ratio=0.01)+residual+raw+fp32+allgather", None),
    ("dgc(ratio=0.01)+none+raw+fp32+allgather", None),
    ("dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+rle+fp32+allgather", "codecs"),
    ("dgc(ratio=0.01)+residual+raw+fp16+allgather", "codecs"),
    ("dgc(ratio=0.01)+residual+raw(bits=64)+fp32+allgather", "codecs"),
    ("topk(ratio=0.01)+residual+raw+fp32+allgather", "sparsifier"),
    ("dgc(k=10)+residual+raw+fp32+allgather", "sparsifier"),
    ("dgc(ratio=0.01)+dgc_momentum(momentum=0.9,clip=1.0)+raw+fp32+allgather", "clipping"),
    ("dgc(ratio=0.01)+residual+raw+fp32+sparse_allreduce", "transport"),
])
def test_the_device_path_takes_the_pipelines_whose_every_stage_has_a_device_form(spec, why):
    reason = device_native(parse_spec(spec))
    assert reason is None if why is None else why in reason


def layout_of(sizes: list[int], whole: frozenset[int] = frozenset()) -> BucketLayout:
    segments, start = [], 0
    for i, numel in enumerate(sizes):
        segments.append(Segment(f"p{i}", start, numel, whole=i in whole))
        start += numel
    return BucketLayout.of(segments, start, torch.device("cpu"))


def test_a_selection_has_the_capacity_never_an_entry_sent_whole_and_no_repeats(global_rng_untouched):
    layout = layout_of([3000, 17, 50_000, 400, 9000], whole=frozenset({1, 3}))
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    chosen = select(values, layout, 0.01, torch.Generator().manual_seed(2))
    _, capacity = layout.at_ratio(0.01)
    assert capacity == 30 + 500 + 90 and chosen.numel() == capacity
    assert chosen.unique().numel() == capacity
    assert not set(chosen.tolist()) & set(layout.whole.tolist())
    again = select(values, layout, 0.01, torch.Generator().manual_seed(2))
    assert torch.equal(chosen.sort().values, again.sort().values)  # seeded alike, chosen alike


def test_each_tensor_sends_about_its_share_whatever_its_scale():
    sizes = [200_000, 5000, 700, 30_000]
    layout = layout_of(sizes)
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(4))
    values[:200_000] *= 10  # a scale of its own: each tensor is measured against its own threshold
    values[205_000:205_700] *= 0.01
    shares = torch.zeros(len(sizes))
    for seed in range(10):
        chosen = select(values, layout, 0.01, torch.Generator().manual_seed(seed))
        shares += torch.bucketize(chosen, torch.tensor([200_000, 205_000, 205_700]), right=True).bincount(
            minlength=len(sizes))
    counts = torch.tensor([-(-numel // 100) for numel in sizes])
    assert torch.equal(shares / 10, counts.float()), shares / 10  # each its own count


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2])
def test_each_tensor_sends_its_own_top_k_as_dgc_does(ratio):
    sizes = [2560, 131_072, 300, 40_000, 7]
    layout = layout_of(sizes, whole=frozenset({2}))
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(8))
    values[2560:133_632] *= 100
    chosen = set(select(values, layout, ratio, torch.Generator().manual_seed(1)).tolist())
    for segment in layout.segments:
        if not segment.whole:
            k = max(1, -(-int(segment.numel * ratio * 1e6) // 10**6))
            top = torch.topk(values[segment.start:segment.start + segment.numel].abs(), k).indices + segment.start
            assert set(top.tolist()) <= chosen, segment


@pytest.mark.parametrize("feedback", [Residual(), DGCMomentum(momentum=0.9), DGCMomentum(momentum=0.9, nesterov=True),
                                      DGCMomentum(momentum=0.5, masking=False)])
def test_propose_and_commit_leave_the_host_feedbacks_state(feedback):
    generator = torch.Generator().manual_seed(6)
    host: dict = {}
    buffers = {name: torch.zeros(500) for name in buffer_names(feedback)}
    for step in range(4):
        grad = torch.randn(500, generator=generator)
        sent = torch.randperm(500, generator=generator)[:37]
        accumulated = feedback.accumulate(grad, host)
        expected = accumulated[sent].clone()
        feedback.update(accumulated, SparseGradient(sent, expected, accumulated.shape), host)
        proposal = propose(feedback, grad, buffers)
        assert torch.allclose(proposal.accumulated[sent], expected, rtol=0, atol=1e-6)
        commit(feedback, buffers, proposal, sent, None, None)
        for name, buffer in buffers.items():
            assert torch.allclose(buffer, host[name], rtol=0, atol=1e-6), (name, step)


def test_a_non_finite_step_commits_nothing_and_entries_sent_whole_hold_nothing():
    feedback = DGCMomentum(momentum=0.9)
    buffers = {name: torch.full((10,), 2.0) for name in buffer_names(feedback)}
    before = {name: buffer.clone() for name, buffer in buffers.items()}
    proposal = propose(feedback, torch.full((10,), float("nan")), buffers)
    commit(feedback, buffers, proposal, torch.tensor([1, 2]), None, torch.tensor(False))
    assert all(torch.equal(buffers[name], before[name]) for name in buffers)
    proposal = propose(feedback, torch.ones(10), buffers)
    commit(feedback, buffers, proposal, torch.tensor([1]), torch.tensor([7, 8]), torch.tensor(True))
    assert all(float(buffers[name][7:9].abs().sum()) == 0 for name in buffers)
    assert float(buffers["accumulated"][1]) == 0 and float(buffers["accumulated"][0]) != 0


def test_the_wire_sums_every_ranks_entries_and_flags_a_stranger():
    numel, capacity, digest = 50, 6, 1234
    generator = torch.Generator().manual_seed(7)
    buffers, expected = [], torch.zeros(numel)
    for _ in range(3):
        indices = torch.randperm(numel, generator=generator)[:capacity]
        values = torch.randn(capacity, generator=generator)
        expected.index_add_(0, indices, values)
        buffers.append(pack(torch.empty(words(capacity), dtype=torch.int32), digest, indices, values).clone())
    total, agreed = unpack_sum(torch.cat(buffers), 3, numel, digest, torch.device("cpu"))
    assert bool(agreed) and torch.allclose(total, expected)
    stranger = buffers[2].clone()
    stranger[0] = digest + 1
    stranger[1] = 10**6  # out of range: clamped, never out of bounds
    _, agreed = unpack_sum(torch.cat([buffers[0], buffers[1], stranger]), 3, numel, digest, torch.device("cpu"))
    assert not bool(agreed)


def test_an_empty_tensor_in_a_bucket_sends_nothing_and_breaks_nothing():
    layout = layout_of([0, 500, 0])
    chosen = select(torch.randn(500, generator=torch.Generator().manual_seed(9)), layout, 0.01,
                    torch.Generator().manual_seed(0))
    assert chosen.numel() == 5 and bool((chosen < 500).all())
