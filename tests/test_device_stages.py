"""The device path's stages on their own: which pipelines it runs, the fixed-size selection, the
feedback's propose/commit against the host feedback, and the fixed-size wire."""

import math

import numpy as np
import pytest
import torch

from sparsecomm.bench.op_counts import count_ops
from sparsecomm.device import indices as packed_indices
from sparsecomm.device import values as device_values
from sparsecomm.device.bitpack import pack_at, pack_bits, pack_fields, unpack_bits, unpack_fields, width_for, words_for
from sparsecomm.device.feedback import buffer_names, commit, propose
from sparsecomm.device.layout import BucketLayout
from sparsecomm.device.selection import select, select_shared
from sparsecomm.device.shares import MAX_SHARE, lowered, rounded
from sparsecomm.device.status import Status, read
from sparsecomm.device.support import device_native
from sparsecomm.device.wire import HEADER, WireFormat
from sparsecomm.encode.base import VALUE_CODECS
from sparsecomm.encode.value.int8 import Int8Values
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
    ("dgc(ratio=0.01)+residual+packed+fp16+allgather", None),
    ("dgc(ratio=0.01)+residual+packed+int8(bucket=64)+allgather", None),
    ("dgc(ratio=0.01)+residual+raw+bf16+allgather", None),
    ("adaptive+dgc_momentum(masking=false,nesterov=true)+packed+int8+allgather", None),
    ("adaptive+dgc_momentum(masking=false,nesterov=true)+rice+int8+allgather", "index codec rice"),
    ("dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+rle+fp32+allgather", "index codec rle"),
    ("dgc(ratio=0.01)+residual+raw(bits=64)+fp32+allgather", "index codec raw"),
    ("dgc(ratio=0.01)+residual+packed+qsgd+allgather", "value codec qsgd"),
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


def padded(values: torch.Tensor) -> torch.Tensor:
    """A bucket's values as `select` takes them: the padding entry, zero, after them."""
    return torch.cat([values, torch.zeros(1)])


def test_a_selection_has_the_capacity_never_an_entry_sent_whole_and_no_repeats(global_rng_untouched):
    layout = layout_of([3000, 17, 50_000, 400, 9000], whole=frozenset({1, 3}))
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    chosen = select(padded(values), layout, 0.01, torch.Generator().manual_seed(2))
    capacity = layout.at_ratio(0.01).capacity
    assert capacity == 30 + 500 + 90 and chosen.numel() == capacity
    assert chosen.unique().numel() == capacity
    assert not set(chosen.tolist()) & set(layout.whole.tolist())
    again = select(padded(values), layout, 0.01, torch.Generator().manual_seed(2))
    assert torch.equal(chosen.sort().values, again.sort().values)  # seeded alike, chosen alike


def test_each_tensor_sends_about_its_share_whatever_its_scale():
    sizes = [200_000, 5000, 700, 30_000]
    layout = layout_of(sizes)
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(4))
    values[:200_000] *= 10  # a scale of its own: each tensor is measured against its own threshold
    values[205_000:205_700] *= 0.01
    shares = torch.zeros(len(sizes))
    for seed in range(10):
        chosen = select(padded(values), layout, 0.01, torch.Generator().manual_seed(seed))
        shares += torch.bucketize(chosen, torch.tensor([200_000, 205_000, 205_700]), right=True).bincount(
            minlength=len(sizes))
    counts = torch.tensor([-(-numel // 100) for numel in sizes])
    # each near its own count: the scores compare each tensor's entries with its own threshold
    assert ((shares / 10 - counts).abs() <= 0.1 * counts + 1).all(), shares / 10


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2])
def test_each_tensor_sends_its_own_largest_entries_about_k_of_them_as_dgc_does(ratio):
    sizes = [2560, 131_072, 300, 40_000, 7]
    layout = layout_of(sizes, whole=frozenset({2}))
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(8))
    values[2560:133_632] *= 100
    chosen = select(padded(values), layout, ratio, torch.Generator().manual_seed(1))
    for segment in layout.segments:
        if segment.whole:
            continue
        k = max(1, -(-int(segment.numel * ratio * 1e6) // 10**6))
        mine = chosen[(chosen >= segment.start) & (chosen < segment.start + segment.numel)]
        top = torch.topk(values[segment.start:segment.start + segment.numel].abs(), mine.numel()).indices
        assert set((top + segment.start).tolist()) == set(mine.tolist()), segment  # its largest, none skipped
        assert abs(mine.numel() - k) <= 0.35 * k + 2, (segment, mine.numel(), k)  # about its k


@pytest.mark.parametrize(("ratio", "scale"), [(0.001, 1.0), (0.01, 1.0), (0.2, 1.0), (1.0, 1.0), (0.01, 0.01)])
def test_a_processor_chooses_what_the_device_form_chooses(ratio, scale):
    """On a CPU the selection runs a segment at a time in host memory; it sends the same entries as
    the device form's fixed-size ops would (``scale`` < 1: thresholds so low that the candidates
    overflow the compaction, and the earliest are kept)."""
    from sparsecomm.device.selection import _select_in_host_memory, _select_on_device, thresholds

    layout = layout_of([2560, 131_072, 300, 40_000, 7, 0, 9000], whole=frozenset({2}))
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(6))
    values[40_000:60_000] = 0.0  # fewer candidates than the capacity in places
    values[2560:133_632] *= 100
    accumulated = padded(values)
    threshold = thresholds(accumulated, layout, ratio, torch.Generator().manual_seed(3)) * scale
    capacity = layout.at_ratio(ratio).capacity
    on_device = _select_on_device(accumulated, threshold, threshold, layout, capacity)
    per_sparsified = threshold[layout.sparsified].numpy()
    in_memory = _select_in_host_memory(accumulated, per_sparsified, per_sparsified, layout, capacity)
    assert torch.equal(on_device, in_memory)
    if scale == 1.0:
        assert torch.equal(select(accumulated, layout, ratio, torch.Generator().manual_seed(3)), in_memory)


def chosen_per_segment(chosen: torch.Tensor, layout: BucketLayout) -> list[int]:
    ends = torch.tensor([s.start + s.numel for s in layout.segments])
    used = chosen[chosen < layout.numel]
    return torch.bucketize(used, ends, right=True).bincount(minlength=len(layout.segments)).tolist()


def test_one_threshold_over_the_bucket_gives_a_tensor_that_stands_out_more_than_its_floor():
    layout = layout_of([200_000, 5000, 30_000])
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(4))
    values[200_000:205_000] *= 10  # a small tensor whose gradient stands out
    ratio, floors = 0.01, [2000, 50, 300]
    _, proposed = select_shared(padded(values), layout, ratio, 1.0, torch.Generator().manual_seed(1))
    share = float(proposed)
    assert 1.3 < share <= MAX_SHARE  # it asks for more than the floors' count
    # the share sizes the capacity; every tensor keeps about its floor, the one standing out more
    chosen = select_shared(padded(values), layout, ratio, share, torch.Generator().manual_seed(1))[0]
    assert chosen.numel() == math.ceil(sum(floors) * rounded(share)) and chosen.unique().numel() == chosen.numel()
    counts = chosen_per_segment(chosen, layout)
    assert counts[1] >= 3 * floors[1], counts
    # a sampled threshold's count errs by about 1/√22 at these floors
    assert all(count >= 0.6 * floor for count, floor in zip(counts, floors, strict=True)), counts
    # within the planned density's capacity (a byte budget): the floors make way
    within = select_shared(padded(values), layout, ratio, share, torch.Generator().manual_seed(1), within=True)[0]
    assert within.numel() == sum(floors) and within.unique().numel() == sum(floors)
    counts = chosen_per_segment(within, layout)
    assert counts[1] >= 3 * floors[1] and counts[0] >= 0.6 * floors[0] / rounded(share), counts
    # where no tensor stands out, the floors take about the whole capacity
    alike = torch.randn(layout.numel, generator=torch.Generator().manual_seed(5))
    _, proposed = select_shared(padded(alike), layout, ratio, 1.0, torch.Generator().manual_seed(1))
    assert 1.0 <= float(proposed) < 1.2


def test_a_processor_chooses_what_the_device_form_chooses_under_one_threshold_over_the_bucket():
    from sparsecomm.device import selection
    from sparsecomm.device.shares import lowered_in_host_memory

    layout = layout_of([2560, 131_072, 300, 40_000, 7], whole=frozenset({2}))
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(6))
    values[:2560] *= 30
    accumulated, ratio, share = padded(values), 0.01, 1.5
    grid = layout.at_ratio(ratio / share).grid
    samples = selection._sampled(accumulated, grid, torch.Generator().manual_seed(3))
    own, floor = selection._at_ranks(samples, grid, grid.both_ranks).unbind(1)
    candidates, members, proposed = lowered(samples, grid, own, floor)
    on_host = lowered_in_host_memory(samples.numpy(), grid, own.numpy(), floor.numpy())
    assert np.array_equal(candidates.numpy(), on_host[0]) and np.array_equal(members.numpy(), on_host[1])
    assert float(proposed) == pytest.approx(on_host[2], rel=1e-5)
    capacity = layout.at_ratio(ratio).capacity
    on_device = selection._select_on_device(accumulated, selection._per_segment(layout, accumulated, candidates),
                                            selection._per_segment(layout, accumulated, members), layout, capacity)
    chosen, in_memory = select_shared(accumulated, layout, ratio, share, torch.Generator().manual_seed(3), within=True)
    assert torch.equal(on_device, chosen) and in_memory == pytest.approx(float(proposed), rel=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_a_processor_sorts_only_the_pools_head_and_finds_the_thresholds_a_full_sort_does(seed):
    from sparsecomm.device.shares import _descending_head

    rng = np.random.default_rng(seed)
    rows, width = int(rng.integers(1, 9)), int(rng.integers(4, 400))
    # few distinct magnitudes (ties across rows) and padding at -1, which weighs nothing
    pool = rng.integers(0, 12, size=(rows, width)).astype(np.float32) / 4
    counts = rng.integers(1, width + 1, size=rows)
    padded = np.arange(width)[None, :] >= counts[:, None]
    pool[padded] = -1.0
    weights = np.where(padded, 0.0, rng.integers(1, 40, size=(rows, 1))).astype(np.float32).reshape(-1)
    flat = pool.reshape(-1)
    full = np.argsort(-flat, kind="stable")
    total = float(weights.sum())
    for reach in (1.0, 0.1 * total, 0.5 * total, total, 2 * total):
        head = _descending_head(flat, weights, reach)
        assert np.array_equal(head, full[:head.size])  # a prefix of the full order
        if reach <= total:  # which reaches the weight asked for
            assert np.cumsum(weights[head], dtype=np.float64)[-1] >= reach * (1 - 1e-6)


def test_the_wire_carries_each_ranks_proposed_share_and_every_receiver_reads_the_largest():
    form = WireFormat(100, 4, 0, VALUE_CODECS.parse("fp32"), packed=True)
    buffers = []
    for share in (torch.tensor(1.25), 1.75, None):
        buffer = torch.empty(form.words, dtype=torch.int32)
        form.pack(buffer, 9, torch.tensor([1, 5, 9, 100]), torch.ones(4), share)
        buffers.append(buffer)
    assert float(form.unpack_sum(torch.cat(buffers), 3, 9, None, torch.device("cpu"), shares=True).share) == 1.75


@pytest.mark.parametrize(("share", "read_back"), [(1.3, 1.3125), (1.0, 1.0), (0.4, 1.0), (7.0, 2.0), (2.0, 2.0)])
def test_a_status_word_brings_the_share_rounded_up_to_a_sixteenth_within_its_bounds(share, read_back):
    status = read(torch.tensor(3), torch.tensor(5.0), torch.tensor(0.01), torch.tensor(share))
    assert status.share == read_back == rounded(share) and status.good and status.magnitude >= 5.0
    assert status.density == pytest.approx(0.01)


def fresh(feedback, numel: int, fill: float = 0.0) -> tuple[dict, dict]:
    """A bucket's current and spare buffers for ``feedback``: ``numel`` entries and the padding."""
    current = {name: torch.full((numel + 1,), fill) for name in buffer_names(feedback)}
    for buffer in current.values():
        buffer[-1] = 0.0
    return current, {name: torch.zeros(numel + 1) for name in current}


@pytest.mark.parametrize("feedback", [Residual(), DGCMomentum(momentum=0.9), DGCMomentum(momentum=0.9, nesterov=True),
                                      DGCMomentum(momentum=0.5, masking=False)])
def test_propose_and_commit_leave_the_host_feedbacks_state(feedback):
    generator = torch.Generator().manual_seed(6)
    host: dict = {}
    current, spare = fresh(feedback, 500)
    for step in range(4):
        grad = torch.randn(500, generator=generator)
        sent = torch.randperm(500, generator=generator)[:37]
        accumulated = feedback.accumulate(grad, host)
        expected = accumulated[sent].clone()
        feedback.update(accumulated, SparseGradient(sent, expected, accumulated.shape), host)
        proposal = propose(feedback, grad, current, spare)
        assert torch.allclose(proposal.accumulated[sent], expected, rtol=0, atol=1e-6)
        commit(feedback, proposal, torch.cat([sent, torch.tensor([500])]), None)  # and an unused slot
        current, spare = spare, current
        for name, buffer in current.items():
            assert torch.allclose(buffer[:-1], host[name], rtol=0, atol=1e-6), (name, step)
            assert float(buffer[-1]) == 0.0  # the padding stays zero


@pytest.mark.parametrize("feedback", [Residual(), DGCMomentum(momentum=0.9)])
def test_what_a_lossy_value_codec_rounds_off_stays_in_the_feedback(feedback):
    current, spare = fresh(feedback, 100)
    grad = torch.randn(100, generator=torch.Generator().manual_seed(5))
    proposal = propose(feedback, grad, current, spare)
    sent = torch.tensor([3, 50, 99])
    delivered = proposal.accumulated[sent].half().float()
    lost = proposal.accumulated[sent] - delivered
    commit(feedback, proposal, sent, None, delivered)
    held = proposal.state["residual" if isinstance(feedback, Residual) else "accumulated"]
    assert torch.equal(held[sent], lost) and bool(lost.abs().max() > 0)


def test_a_proposal_touches_only_the_spare_buffers_and_entries_sent_whole_hold_nothing():
    feedback = DGCMomentum(momentum=0.9)
    current, spare = fresh(feedback, 10, fill=2.0)
    before = {name: buffer.clone() for name, buffer in current.items()}
    propose(feedback, torch.full((10,), float("nan")), current, spare)  # a step that is never committed
    assert all(torch.equal(current[name], before[name]) for name in current)
    proposal = propose(feedback, torch.ones(10), current, spare)
    commit(feedback, proposal, torch.tensor([1]), torch.tensor([7, 8]))
    assert all(float(spare[name][7:9].abs().sum()) == 0 for name in spare)
    assert float(spare["accumulated"][1]) == 0 and float(spare["accumulated"][0]) != 0


FORMATS = [("fp32", False), ("fp32", True), ("fp16", True), ("bf16", False), ("int8(bucket=4)", True)]


@pytest.mark.parametrize(("value_codec", "packed"), FORMATS)
def test_the_wire_sums_every_ranks_entries_as_each_sender_says_they_arrive_and_flags_a_stranger(value_codec, packed):
    numel, capacity, digest = 50, 6, 1234
    whole = torch.tensor([47, 48, 49])
    form = WireFormat(numel, capacity, whole.numel(), VALUE_CODECS.parse(value_codec), packed=packed)
    generator = torch.Generator().manual_seed(7)
    buffers, expected = [], torch.zeros(numel)
    for _ in range(3):
        indices = torch.randperm(47, generator=generator)[:capacity].sort().values
        values, whole_values = torch.randn(capacity, generator=generator), torch.randn(3, generator=generator)
        buffer = torch.empty(form.words, dtype=torch.int32)
        delivered = form.pack(buffer, digest, indices, torch.cat([values, whole_values]))
        assert torch.allclose(delivered, torch.cat([values, whole_values]), rtol=0.01, atol=0.03)
        expected.index_add_(0, indices, delivered[:capacity]).index_add_(0, whole, delivered[capacity:])
        buffers.append(buffer)
    total, agreed, _, share = form.unpack_sum(torch.cat(buffers), 3, digest, whole, torch.device("cpu"), shares=True)
    assert bool(agreed) and torch.allclose(total, expected, rtol=0, atol=1e-6) and float(share) == 0.0
    stranger = buffers[2].clone()
    stranger[0] = digest + 1
    stranger[HEADER] = -1  # out of range: clamped, never out of bounds
    _, agreed, _, _ = form.unpack_sum(torch.cat([buffers[0], buffers[1], stranger]), 3, digest, whole,
                                torch.device("cpu"))
    assert not bool(agreed)


def test_bit_fields_round_trip_at_every_width():
    generator = torch.Generator().manual_seed(8)
    assert [width_for(n) for n in (1, 2, 3, 166_000, 2**32)] == [1, 1, 2, 18, 32]
    for width in range(1, 33):
        for count in (0, 1, 31, 100):
            fields = torch.randint(0, 2**width, (count,), generator=generator, dtype=torch.int64)
            words = pack_fields(fields, width, torch.empty(words_for(count, width), dtype=torch.int32))
            assert torch.equal(unpack_fields(words, width, count), fields), (width, count)


def test_single_bits_move_a_byte_at_a_time_as_the_field_packer_lays_them_out():
    generator = torch.Generator().manual_seed(9)
    for count in (0, 1, 7, 8, 33, 1000):
        bits = torch.randint(0, 2, (count,), generator=generator, dtype=torch.int64)
        nwords = words_for(count + 40, 1)
        assert torch.equal(pack_bits(bits.to(torch.uint8), torch.empty(nwords, dtype=torch.int32)),
                           pack_fields(bits, 1, torch.empty(nwords, dtype=torch.int32))), count
        for start in (0, 1, 5, 8, 13, 31, 32, 39):
            words = pack_fields(bits, 1, torch.empty(nwords, dtype=torch.int32), start=start)
            assert torch.equal(unpack_bits(words, count, start).long(), bits), (count, start)
            assert torch.equal(unpack_bits(torch.stack([words, words]), count, start).long(),
                               torch.stack([bits, bits])), (count, start)


@pytest.mark.parametrize("padded", [False, True])
def test_a_bitmap_of_indices_is_its_fields_laid_out_bit_by_bit(padded):
    """A dense selection packs as a bitmap (one bit a position, after the unused slots' count when
    padded): the bytes the single-bit packer writes are those of the fields, one per position."""
    space, count, unused = 1000, 600, 7 if padded else 0
    assert packed_indices.block_bits(space, count) == 0
    chosen = torch.randperm(space, generator=torch.Generator().manual_seed(5))[:count - unused].sort().values
    chosen = torch.cat([chosen, torch.full((unused,), space)])
    nwords = packed_indices.nwords(space, count, padded)
    words = packed_indices.encode(chosen, space, torch.empty(nwords, dtype=torch.int32), padded=padded)
    marks = torch.zeros(space, dtype=torch.int64)
    marks[chosen[chosen < space]] = 1
    start = width_for(count + 1) if padded else 0
    fields = torch.cat([marks, torch.tensor([unused])])  # the unused slots' count first in the stream
    places = torch.cat([start + torch.arange(space), torch.tensor([0])])
    assert torch.equal(words, pack_at(fields, places, torch.empty(nwords, dtype=torch.int32)))
    back, sound = packed_indices.decode(words, space, count, padded=padded)
    assert torch.equal(back, chosen) and bool(sound)


@pytest.mark.parametrize("density", [0.0005, 0.001, 0.01, 0.05, 0.25, 0.5])
def test_packed_indices_round_trip_within_half_again_the_information_bound(density):
    space = 1 << 20
    count = int(space * density)
    chosen = torch.randperm(space, generator=torch.Generator().manual_seed(3))[:count].sort().values
    words = packed_indices.encode(chosen, space, torch.empty(packed_indices.nwords(space, count), dtype=torch.int32))
    back, sound = packed_indices.decode(words, space, count)
    assert torch.equal(back, chosen) and bool(sound)
    bound = (math.lgamma(space + 1) - math.lgamma(count + 1) - math.lgamma(space - count + 1)) / math.log(2)
    assert 32 * words.numel() <= 1.5 * bound + 64, (32 * words.numel() / count, bound / count)
    assert 32 * words.numel() <= space + 32  # never more than a bitmap


@pytest.mark.parametrize(("space", "capacity"), [(76_810, 3918), (1000, 600), (1000, 10), (64, 64), (100_000, 3)])
def test_padded_packed_indices_carry_any_number_of_unused_slots_row_by_row(space, capacity):
    """The device route's selection names ``space`` in its unused slots: however many (a bucket whose
    gradient is mostly zeros leaves most of its capacity unused), each row decodes as it was sent."""
    generator = torch.Generator().manual_seed(space + capacity)
    rows = []
    for used in (capacity, capacity - 1, capacity // 2, 0):
        chosen = torch.randperm(space, generator=generator)[:used].sort().values
        rows.append(torch.cat([chosen, torch.full((capacity - used,), space)]))
    words = torch.stack([packed_indices.encode(row, space, torch.empty(packed_indices.nwords(space, capacity, True),
                                                                       dtype=torch.int32), padded=True)
                         for row in rows])
    back, sound = packed_indices.decode(words, space, capacity, padded=True)
    assert torch.equal(back, torch.stack(rows)) and bool(sound.all())


@pytest.mark.parametrize(("space", "capacity"), [(169_834, 8300), (1000, 600), (64, 64), (100_000, 3)])
def test_packed_indices_with_their_fields_placed_once_are_the_same_bits(space, capacity):
    """A buffer of fixed sizes places its fields once (`Stream`) and reuses them: the stream is the
    same, bit for bit, for every selection, as one whose fields are placed on the call."""
    generator = torch.Generator().manual_seed(capacity)
    stream = packed_indices.Stream.of(space, capacity, True, torch.device("cpu"))
    for used in (capacity, capacity // 3, 0):
        chosen = torch.randperm(space, generator=generator)[:used].sort().values
        row = torch.cat([chosen, torch.full((capacity - used,), space)])
        size = packed_indices.nwords(space, capacity, True)
        placed = packed_indices.encode(row, space, torch.empty(size, dtype=torch.int32), True, stream=stream)
        assert torch.equal(placed, packed_indices.encode(row, space, torch.empty(size, dtype=torch.int32), True))
        back, sound = packed_indices.decode(placed[None], space, capacity, True, stream=stream)
        assert torch.equal(back[0], row) and bool(sound.all())
    # a stream of other sizes is not used for these
    other = packed_indices.Stream.of(space, capacity + 1, True, torch.device("cpu"))
    row = torch.full((capacity,), space)
    words = packed_indices.encode(row, space, torch.empty(packed_indices.nwords(space, capacity, True),
                                                          dtype=torch.int32), True, stream=other)
    assert torch.equal(packed_indices.decode(words, space, capacity, True, stream=other)[0], row)


def test_a_wire_format_places_its_fields_once_and_packs_in_fewer_ops_so():
    codec = VALUE_CODECS.parse("int8")
    numel, capacity = 50_000, 2000
    kept = WireFormat(numel, capacity, 10, codec, packed=True)
    assert kept.stream(torch.device("cpu")) is kept.stream(torch.device("cpu"))
    indices = torch.randperm(numel - 10, generator=torch.Generator().manual_seed(2))[:capacity].sort().values
    values, out = torch.randn(capacity + 10), torch.empty(kept.words, dtype=torch.int32)
    kept.pack(out, 5, indices, values)
    each_call = count_ops(lambda: WireFormat(numel, capacity, 10, codec, packed=True).pack(out, 5, indices, values), 3)
    assert count_ops(lambda: kept.pack(out, 5, indices, values), 3).ops < each_call.ops


def test_a_bucket_keeps_its_latest_wire_formats_by_capacity():
    from sparsecomm.reducer.paths.device import FORMS_KEPT, Bucket, BufferSet

    spec = parse_spec("adaptive+residual+packed+int8+allgather")
    bucket = Bucket(layout_of([3000, 17, 5000], whole=frozenset({1})), (), BufferSet({}, []))
    first = bucket.form(40, spec)
    assert bucket.form(40, spec) is first and (first.capacity, first.whole, first.packed) == (40, 17, True)
    for capacity in range(41, 41 + FORMS_KEPT):
        bucket.form(capacity, spec)
    assert len(bucket.forms) == FORMS_KEPT and 40 not in bucket.forms  # the least recently used went


def test_packed_indices_whose_counts_do_not_add_up_are_flagged():
    space, count = 10_000, 40
    chosen = torch.randperm(space, generator=torch.Generator().manual_seed(4))[:count].sort().values
    words = packed_indices.encode(chosen, space, torch.empty(packed_indices.nwords(space, count), dtype=torch.int32))
    words[0] ^= 1 << 3  # one block's count
    back, sound = packed_indices.decode(words, space, count)
    assert not bool(sound) and back.numel() == count


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_makes_its_int8_block_decode_non_finite(bad):
    codec = Int8Values(bucket=4)
    values = torch.tensor([1.0, bad, 2.0, 3.0, 0.5, 0.25])
    out = torch.empty(device_values.nwords(codec, 6), dtype=torch.int32)
    delivered = device_values.encode(codec, values, out)
    decoded = device_values.decode(codec, out[None], 6)[0]
    assert torch.equal(decoded.isfinite(), delivered.isfinite())
    assert not bool(decoded[:4].isfinite().any()) and bool(decoded[4:].isfinite().all())


def test_an_empty_tensor_in_a_bucket_sends_nothing_and_breaks_nothing():
    layout = layout_of([0, 500, 0])
    chosen = select(padded(torch.randn(500, generator=torch.Generator().manual_seed(9))), layout, 0.01,
                    torch.Generator().manual_seed(0))
    assert chosen.numel() == 5 and bool((chosen < 500).all())


@pytest.mark.parametrize(("value_codec", "packed"), FORMATS)
def test_a_bucket_of_zeros_fills_its_capacity_with_the_padding_and_sums_to_zero(value_codec, packed):
    layout = layout_of([3000, 40, 9000], whole=frozenset({1}))
    chosen = select(torch.zeros(layout.numel + 1), layout, 0.01, torch.Generator().manual_seed(0))
    capacity = layout.at_ratio(0.01).capacity
    assert chosen.numel() == capacity and bool((chosen == layout.numel).all())
    form = WireFormat(layout.numel, capacity, 40, VALUE_CODECS.parse(value_codec), packed=packed)
    buffer = torch.empty(form.words, dtype=torch.int32)
    form.pack(buffer, layout.digest, chosen, torch.zeros(capacity + 40))
    total, agreed, _, _ = form.unpack_sum(torch.cat([buffer, buffer]), 2, layout.digest, layout.whole,
                                    torch.device("cpu"))
    assert bool(agreed) and not bool(total.any())


@pytest.mark.parametrize("flags", [0, 1, 2, 3])
def test_a_status_word_brings_the_flags_the_magnitude_rounded_up_and_the_density_in_one_read(flags):
    magnitude, density = torch.tensor(1234.5678), torch.tensor(0.0123456789, dtype=torch.float64)
    counts = count_ops(lambda: read(torch.tensor(flags), magnitude, density), 1)
    assert counts.syncs == 1
    status = read(torch.tensor(flags), magnitude, density)
    assert status.flags == flags and status.good == bool(flags & 1) and status.own_finite == bool(flags & 2)
    assert 1234.5678 <= status.magnitude <= 1234.5678 * 1.01  # never below: it guards fp16's range
    assert status.density == pytest.approx(0.0123456789, rel=1e-7)  # float32's precision
    assert read(torch.tensor(flags)) == Status(flags)  # nothing asked, nothing read
    assert read(torch.tensor(3), torch.tensor(math.inf)).magnitude == math.inf


def test_what_int8_rounds_off_the_entries_sent_whole_goes_with_their_next_step():
    from sparsecomm.device.whole import WholeError
    from sparsecomm.pipeline import TensorState

    codec = VALUE_CODECS.parse("int8(bucket=4)")
    layout = layout_of([300, 5, 9000, 3], whole=frozenset({1, 3}))
    states = [TensorState() for _ in layout.segments]
    error = WholeError.of(codec, layout, states)
    assert WholeError.of(VALUE_CODECS.parse("fp32"), layout, states) is None  # exact: nothing to keep
    generator = torch.Generator().manual_seed(11)
    sent_in_all, delivered_in_all = torch.zeros(8), torch.zeros(8)
    for _ in range(20):
        gradient = torch.randn(layout.numel, generator=generator)
        sent = error.sent(gradient)
        delivered = device_values.encode(codec, sent, torch.empty(device_values.nwords(codec, 8), dtype=torch.int32))
        error.propose(sent, delivered)
        error.keep()
        sent_in_all += gradient[layout.whole]
        delivered_in_all += delivered
    # each parameter's state is its view of the kept error, under the host path's name
    assert all(state.codec_error is view for state, view in error.views[0]) and states[0].codec_error is None
    assert states[1].codec_error.data_ptr() == error.held.data_ptr() and torch.equal(states[3].codec_error,
                                                                                   error.held[5:])
    assert float(error.held.abs().max()) > 0  # int8 rounded something off
    torch.testing.assert_close(delivered_in_all + error.held, sent_in_all)  # nothing lost, only late
    # another route's steps: a dense one leaves no error, one on the codecs its own tensor
    states[1].codec_error, states[3].codec_error = None, torch.arange(3.0)
    error.reclaim()
    assert all(state.codec_error is view for state, view in error.views[0])
    assert torch.equal(error.held, torch.tensor([0.0] * 5 + [0.0, 1.0, 2.0]))


def test_a_sum_that_overflows_is_flagged_from_the_values_received_alone():
    form = WireFormat(10, 2, 0, VALUE_CODECS.parse("fp32"))

    def buffer(indices: list[int], values: list[float]) -> torch.Tensor:
        out = torch.empty(form.words, dtype=torch.int32)
        form.pack(out, 5, torch.tensor(indices), torch.tensor(values))
        return out

    # rank by rank the values cancel, yet entry 1 of the sum overflows
    rows = torch.cat([buffer([1, 2], [3e38, -3e38]), buffer([1, 2], [3e38, -3e38])])
    total, agreed, finite, _ = form.unpack_sum(rows, 2, 5, None, torch.device("cpu"))
    assert bool(agreed) and not bool(total.isfinite().all()) and not bool(finite)
    total, _, finite, _ = form.unpack_sum(torch.cat([buffer([1, 2], [1.0, -2.0])] * 2), 2, 5, None, torch.device("cpu"))
    assert bool(finite) and total.tolist() == [0, 2, -4] + [0] * 7
    nan = torch.cat([buffer([1, 2], [1.0, math.nan]), buffer([0, 3], [1.0, 1.0])])
    assert not bool(form.unpack_sum(nan, 2, 5, None, torch.device("cpu"))[2])
