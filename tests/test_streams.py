"""SparCML's sparse streams: the switch to dense at δ, sums that switch as the union grows, and bytes
that round-trip and refuse corruption."""

import pytest
import torch

import sparsecomm as sc
from sparsecomm.transport.streams import Stream


def test_streams_switch_to_dense_exactly_at_delta():
    """δ = N·isize/(c + isize): fp32 values with int32 indices switch at N/2 nonzeros."""
    numel = 1000
    below = Stream.sparse(torch.arange(499), torch.ones(499), numel)
    at = Stream.sparse(torch.arange(500), torch.ones(500), numel)
    assert not below.is_dense and at.is_dense
    assert below.switch_point() == 500.0
    half = Stream.sparse(torch.arange(0, 1000, 2), torch.ones(500), numel)
    assert half.is_dense and torch.equal(half.to_dense()[:4], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    fp16 = Stream.sparse(torch.arange(333), torch.ones(333, dtype=torch.float16), numel)
    assert not fp16.is_dense and Stream.sparse(torch.arange(334), torch.ones(334, dtype=torch.float16), numel).is_dense


def test_stream_sums_switch_when_the_union_grows():
    numel = 100
    a = Stream.sparse(torch.arange(0, 30), torch.ones(30), numel)
    b = Stream.sparse(torch.arange(30, 60), torch.ones(30), numel)
    assert not a.is_dense and (a + b).is_dense
    c = Stream.sparse(torch.arange(0, 30), torch.ones(30), numel)
    assert not (a + c).is_dense and torch.equal((a + c).to_dense()[:30], torch.full((30,), 2.0))


def test_stream_bytes_round_trip_and_reject_corruption():
    stream = Stream.sparse(torch.tensor([3, 9]), torch.tensor([1.5, -2.0]), 50, offset=100)
    again = Stream.from_bytes(stream.to_bytes())
    assert again.offset == 100 and torch.equal(again.to_dense(), stream.to_dense())
    broken = stream.to_bytes().clone()
    broken[-12] = 200  # an index beyond the range
    with pytest.raises(sc.PayloadError):
        Stream.from_bytes(broken)
    with pytest.raises(sc.PayloadError):
        Stream.from_bytes(stream.to_bytes()[:-1])
