"""Decoders keep the bound `sparsecomm.payload` documents: hostile payloads, built field by field
with a valid checksum, either decode or raise `PayloadError`, and never allocate more than
DECODE_BYTES_PER_BYTE·B + DECODE_BYTES_PER_VALUE·min(nnz, N) + DECODE_OVERHEAD bytes for a B-byte
payload of an N-element tensor. Allocation is measured with tracemalloc, which sees numpy's and
Python's memory (every codec decodes in numpy)."""

import struct
import time
import tracemalloc

import pytest
import torch

import sparsecomm as sc
from helpers import random_sparse
from sparsecomm.fuzz import PayloadParts
from sparsecomm.payload import (
    DECODE_BYTES_PER_BYTE,
    DECODE_BYTES_PER_VALUE,
    DECODE_OVERHEAD,
    FORMAT_VERSION,
    MAGIC,
    SCAN_WITHOUT_EXPECT,
)


def craft(index_text: str, value_text: str, numel: int, nnz: int, index_section: bytes,
          value_section: bytes = b"") -> bytes:
    """A float32 payload of a 1-D tensor with these fields, whatever they say, and a valid CRC."""
    fields = {"magic": MAGIC, "version": FORMAT_VERSION, "flags": 0, "dtype": 1, "ndim": 1, "numel": numel,
              "nnz": nnz}
    return PayloadParts(fields, struct.pack("<Q", numel), index_text, value_text, index_section,
                        value_section).assemble()


def sections(payload: bytes) -> tuple[bytes, bytes]:
    parts = PayloadParts.parse(payload)
    return parts.index_section, parts.value_section


def decode_measured(payload: bytes, expect: int | None = None) -> tuple[object, int, float]:
    """(the decoded gradient or the PayloadError, peak bytes allocated, seconds)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        outcome: object = sc.decode(payload, expect=expect)
    except sc.PayloadError as err:
        outcome = err
    finally:
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return outcome, peak, seconds


def bound(payload: bytes) -> int:
    info = sc.read_info(payload)
    return DECODE_BYTES_PER_BYTE * len(payload) + DECODE_BYTES_PER_VALUE * min(info.nnz, info.numel) + DECODE_OVERHEAD


def bloom_section(bits: int, hashes: int, fill: int = 0xFF) -> bytes:
    return struct.pack("<QQB", 12345, bits, hashes) + bytes([fill]) * -(-bits // 8)


@pytest.mark.parametrize("hashes", [1, 4, 32])
@pytest.mark.parametrize("policy", ["p0", "p1", "p2", "leftmost"])
def test_an_all_ones_bloom_filter_stays_within_the_bound(policy, hashes):
    # every index is a positive: the receiver stops counting at the filter's positives limit
    bits = 8 * 340
    for numel in (1 << 16, 1 << 20):
        nnz = numel if policy == "p0" else 1000
        payload = craft(f"bloom(policy={policy})", "fp32", numel, nnz, bloom_section(bits, hashes),
                        b"\0" * 4 * nnz)
        outcome, peak, _ = decode_measured(payload, expect=numel)
        assert peak <= bound(payload), (numel, peak)
        if isinstance(outcome, sc.SparseGradient):  # under the limit: as many positives as claimed
            assert outcome.nnz == nnz


@pytest.mark.parametrize("hashes", [1, 8, 32])
def test_the_largest_conflict_sets_a_bloom_payload_can_ask_for_stay_within_the_bound(hashes):
    # an all-ones filter over a tensor just as large as its positives limit: p2 sorts them all
    from sparsecomm.encode.index.bloom import positives_limit

    bits = 8 * 2000
    numel = positives_limit(bits, hashes)
    nnz = numel // 2
    payload = craft("bloom(policy=p2)", "fp32", numel, nnz, bloom_section(bits, hashes), b"\0" * 4 * nnz)
    outcome, peak, _ = decode_measured(payload, expect=numel)
    assert isinstance(outcome, sc.SparseGradient) and outcome.nnz == nnz
    assert peak <= bound(payload)


def test_a_bloom_payload_for_a_huge_tensor_needs_the_receivers_expectation():
    payload = craft("bloom(policy=p2)", "fp32", 1 << 40, 1, bloom_section(64, 4, fill=0), b"\0" * 4)
    outcome, _, seconds = decode_measured(payload)
    assert isinstance(outcome, sc.PayloadError) and "expect=" in str(outcome) and seconds < 0.5
    outcome, _, seconds = decode_measured(payload, expect=1 << 20)
    assert isinstance(outcome, sc.PayloadError) and "expects 1048576" in str(outcome) and seconds < 0.5
    assert SCAN_WITHOUT_EXPECT < 1 << 40


def test_a_bloom_filter_with_more_hashes_than_any_sender_uses_is_refused():
    payload = craft("bloom(policy=p2)", "fp32", 1000, 1, bloom_section(64, 64), b"\0" * 4)
    assert isinstance(decode_measured(payload, expect=1000)[0], sc.PayloadError)


def test_a_giant_qsgd_bucket_named_on_the_wire_allocates_per_value_not_per_bucket():
    index, _ = sections(sc.encode(random_sparse(1000, 3, seed=1), "raw", "fp32"))
    value = struct.pack("<f", 1.0) + bytes([0x77, 0x07])  # one norm, three 4-bit levels
    payload = craft("raw", "qsgd(bits=4,bucket=16777216)", 1000, 3, index, value)
    outcome, peak, _ = decode_measured(payload)
    assert isinstance(outcome, sc.SparseGradient) and outcome.nnz == 3
    assert peak < 1 << 20


def test_sketch_parameters_beyond_8_cells_per_key_are_refused_on_the_wire():
    payload = sc.encode(random_sparse(100_000, 3000, seed=2), "skcompress", "fp32")
    index, _ = sections(payload)
    for text in ("skcompress(rows=16,columns=64.0)", "skcompress(rows=4,columns=2.5)"):
        outcome, peak, _ = decode_measured(craft(text, "fp32", 100_000, 3000, index))
        assert isinstance(outcome, sc.PayloadError) and "cells per key" in str(outcome)
        assert peak < 1 << 20
    crafted = craft("skcompress(rows=4,columns=2.0)", "fp32", 100_000, 3000, index)
    outcome, peak, _ = decode_measured(crafted)  # the largest allowed sketch, over the wrong cells
    assert peak <= bound(crafted)


@pytest.mark.parametrize("value_codec", ["deflate", "zstd"])
def test_a_compression_bomb_is_bounded_by_the_tensor_the_receiver_expects(value_codec):
    numel = 1 << 20
    grad = sc.SparseGradient(torch.arange(numel), torch.zeros(numel), torch.Size([numel]))
    payload = sc.encode(grad, "bitmap", value_codec)  # all zeros: a few kilobytes for 4 MB of values
    assert len(payload) < 300_000
    outcome, peak, _ = decode_measured(payload, expect=numel)
    assert isinstance(outcome, sc.SparseGradient) and outcome.nnz == numel
    assert peak <= bound(payload)
    assert isinstance(decode_measured(payload, expect=numel // 2)[0], sc.PayloadError)


@pytest.mark.parametrize("value_codec", ["polyfit(degree=15,segments=255)", "dexp(steps=100)"])
def test_curve_fits_at_their_largest_parameters_stay_within_the_bound(value_codec):
    payload = sc.encode(random_sparse(100_000, 20_000, seed=3), "rice", value_codec)
    outcome, peak, _ = decode_measured(payload, expect=100_000)
    assert isinstance(outcome, sc.SparseGradient)
    assert peak <= bound(payload)


def test_a_negative_index_cannot_pass_as_increasing_through_int64_overflow():
    index = struct.pack("<2q", 5, -(2**63))
    payload = craft("raw(bits=64)", "fp32", 100, 2, index, b"\0" * 8)
    outcome, _, _ = decode_measured(payload)
    assert isinstance(outcome, sc.PayloadError) and "strictly increasing" in str(outcome)


@pytest.mark.parametrize("count", [9, 17, 40])
def test_rice_positions_that_wrap_int32_are_refused(count):
    """Below 2**30 elements Rice sums run in int32: low parts of all ones at b=28 push the true
    positions past 2**31 (and, at 17, round 2**32 back inside the tensor), which must fail."""
    numel, b = 1 << 29, 28
    unary = int("1" * count + "0" * (-count % 8), 2).to_bytes(-(-count // 8), "big")  # quotients all 0
    section = bytes([b]) + unary + b"\xff" * (-(-count * b // 8))
    outcome, _, _ = decode_measured(craft("rice", "fp32", numel, count, section, b"\0" * 4 * count), expect=numel)
    assert isinstance(outcome, sc.PayloadError) and "strictly increasing" in str(outcome)


@pytest.mark.parametrize("index_codec", ["raw", "packed", "bitmap", "rle", "delta_binary", "huffman", "rice"])
def test_the_densest_claim_each_index_codec_allows_stays_within_the_bound(index_codec):
    numel = 1 << 20
    payload = sc.encode(random_sparse(numel, numel // 4, seed=4), index_codec, "fp16")
    outcome, peak, _ = decode_measured(payload, expect=numel)
    assert isinstance(outcome, sc.SparseGradient)
    assert peak <= bound(payload)


def test_non_finite_values_in_a_payload_are_refused():
    # found by the fuzzer: the encoder never sends them, so a payload holding them is corrupt
    index, _ = sections(sc.encode(random_sparse(100, 2, seed=5), "raw", "fp32"))
    payload = craft("raw", "fp32", 100, 2, index, struct.pack("<2f", 1.0, float("nan")))
    assert "finite" in str(decode_measured(payload)[0])
    fitted = sc.SparseGradient(torch.tensor([1, 5]), torch.tensor([0.5, 2.0]), torch.Size([100]))
    index, value = sections(sc.encode(fitted, "raw", "polyfit(degree=1)"))
    coefficient = struct.pack("<f", 1.25)  # the fit's constant term, (0.5 + 2.0) / 2
    assert value.count(coefficient) == 1
    corrupted = value.replace(coefficient, struct.pack("<f", float("nan")))
    payload = craft("raw", "polyfit(degree=1)", 100, 2, index, corrupted)
    assert "coefficients are not finite" in str(decode_measured(payload)[0])
