"""Bad bytes never crash, hang or decode to a wrong tensor: they raise `PayloadError`, which says
what is wrong, and a header can never make decode allocate more than its documented bound."""

import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

import sparsecomm as sc
from helpers import random_sparse
from sparsecomm.payload import _HEADER, FORMAT_VERSION

PAIRS = [(i, v) for i in ["raw", "packed", "bitmap", "rle", "delta_binary", "huffman", "rice"]
         for v in ["fp32", "qsgd(bits=4,bucket=16)", "deflate", "zstd"]]
PAIRS += [("bloom(policy=p0,fpr=0.01)", "fp32"), ("bloom(policy=p2)", "polyfit"), ("bloom(policy=naive)", "dexp"),
          ("rice", "polyfit(degree=2,segments=3)"), ("skcompress", "fp32"), ("skcompress(coder=ans,keys=rice)", "fp32")]


def with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def sample_payload(index_codec="rice", value_codec="fp32", seed=0) -> bytes:
    return sc.encode(random_sparse(5000, 300, seed=seed, shape=(50, 100)), index_codec, value_codec)


def test_every_truncation_is_rejected():
    payload = sample_payload("huffman", "deflate")
    for length in range(len(payload)):
        with pytest.raises(sc.PayloadError):
            sc.decode(payload[:length])


def test_trailing_bytes_are_rejected():
    with pytest.raises(sc.PayloadError, match="truncated"):
        sc.decode(sample_payload() + b"\0")


def test_every_single_bit_flip_is_caught():
    payload = bytearray(sample_payload("rle", "fp16"))
    rng = np.random.default_rng(0)
    for position in rng.choice(len(payload) * 8, size=400, replace=False):
        flipped = bytearray(payload)
        flipped[position // 8] ^= 1 << (position % 8)
        with pytest.raises(sc.PayloadError):
            sc.decode(bytes(flipped))


def test_random_bytes_raise_only_payload_errors():
    rng = np.random.default_rng(1)
    for trial in range(500):
        blob = rng.integers(0, 256, size=int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
        if trial % 2:
            blob = b"SPCM" + bytes([FORMAT_VERSION]) + blob
        with pytest.raises(sc.PayloadError):
            sc.decode(blob)


@pytest.mark.parametrize(("index_codec", "value_codec"), PAIRS)
def test_corrupted_sections_with_a_valid_checksum_raise_payload_errors(index_codec, value_codec):
    """The hard case: the CRC is recomputed, so only each codec's own checks stand in the way.
    Decoding must either raise PayloadError or return a valid gradient of the header's shape."""
    payload = sample_payload(index_codec, value_codec, seed=2)
    info = sc.read_info(payload)
    sections_start = len(payload) - 4 - info.index_bytes - info.value_bytes
    body = bytearray(payload[:-4])
    rng = np.random.default_rng(3)
    for _ in range(60):
        mutated = bytearray(body)
        for position in rng.integers(sections_start, len(body), size=int(rng.integers(1, 4))):
            mutated[position] = int(rng.integers(0, 256))
        try:
            grad = sc.decode(with_crc(bytes(mutated)))
        except sc.PayloadError:
            continue
        assert grad.shape == info.shape and grad.nnz == info.nnz
        assert bool((grad.indices[1:] > grad.indices[:-1]).all()) and int(grad.indices.max()) < info.numel


def rewrite_header(payload: bytes, **fields) -> bytes:
    names = ["magic", "version", "flags", "dtype", "ndim", "numel", "nnz", "index_spec_len",
             "value_spec_len", "index_bytes", "value_bytes"]
    values = dict(zip(names, _HEADER.unpack_from(payload), strict=True))
    values.update(fields)
    body = _HEADER.pack(*values.values()) + payload[_HEADER.size : -4]
    return with_crc(body)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"version": FORMAT_VERSION + 1}, f"format version {FORMAT_VERSION + 1}; this sparsecomm reads version "
                                          f"{FORMAT_VERSION}"),
        ({"magic": b"NOPE"}, "not a sparsecomm payload"),
        ({"dtype": 9}, "unknown dtype code"),
        ({"flags": 0x80}, "unknown flags"),
        ({"ndim": 9}, "dimensions"),
        ({"numel": 4999}, "does not match numel"),
        ({"index_bytes": 1}, "truncated"),
    ],
)
def test_header_fields_are_checked(fields, message):
    with pytest.raises(sc.PayloadError, match=message):
        sc.decode(rewrite_header(sample_payload(), **fields))


@pytest.mark.parametrize(("index_codec", "value_codec"), PAIRS)
def test_a_huge_nnz_claim_is_refused_before_allocating(index_codec, value_codec):
    payload = rewrite_header(sample_payload(index_codec, value_codec), nnz=4999)
    tracemalloc.start()
    try:
        with pytest.raises(sc.PayloadError):
            sc.decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1100 * 4 * len(payload) + (1 << 20)  # the documented bound


def test_a_header_claiming_a_giant_tensor_allocates_nothing_big():
    grad = sc.SparseGradient(torch.tensor([0, 5]), torch.ones(2), torch.Size([2**47]))
    payload = sc.encode(grad, "rice", "fp32")
    tracemalloc.start()
    try:
        decoded = sc.decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoded.indices.tolist() == [0, 5] and decoded.numel == 2**47
    assert peak < 1 << 20
    with pytest.raises(sc.PayloadError):
        sc.decode(rewrite_header(payload, numel=2**49))


def test_unknown_codec_names_on_the_wire_are_payload_errors():
    payload = bytearray(sample_payload("rice", "fp32"))
    position = payload.index(b"rice")
    payload[position : position + 4] = b"ricf"
    with pytest.raises(sc.PayloadError, match="unusable index codec"):
        sc.decode(with_crc(bytes(payload[:-4])))


def test_non_payload_types_are_rejected():
    with pytest.raises(sc.PayloadError, match="bytes or a uint8 tensor"):
        sc.decode("SPCM")  # type: ignore[arg-type]
    with pytest.raises(sc.PayloadError, match="1-D uint8"):
        sc.decode(torch.zeros(10))


def test_crafted_sections_past_their_codecs_bounds_are_refused():
    from dataclasses import replace

    from sparsecomm.encode.bits import pack_planes, pack_unary
    from sparsecomm.fuzz import PayloadParts

    # a shape dimension past the largest tensor, beside a 0 that makes numel 0
    empty = sc.SparseGradient(torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.Size([0, 3]))
    parts = PayloadParts.parse(sc.encode(empty))
    with pytest.raises(sc.PayloadError, match="does not match numel"):
        sc.decode(replace(parts, shape=struct.pack("<2Q", 2**64 - 1, 0)).assemble())
    # bytes after a zstd frame
    grad = sc.SparseGradient(torch.tensor([1, 5, 9]), torch.tensor([1.0, -2.0, 3.0]), torch.Size([10]))
    parts = PayloadParts.parse(sc.encode(grad, "raw", "zstd"))
    with pytest.raises(sc.PayloadError, match="zstd"):
        sc.decode(replace(parts, value_section=parts.value_section + b"\0" * 7).assemble())
    # Rice low parts past the tensor, which int32 arithmetic would wrap back into it
    stream = bytes([40]) + pack_unary(np.zeros(2, np.int64)) + pack_planes(
        np.array([(1 << 33) + 3, (1 << 34) + 5], dtype=np.uint64), 40)
    parts = PayloadParts.parse(sc.encode(sc.SparseGradient(torch.tensor([3, 9]), torch.tensor([1.0, 2.0]),
                                                           torch.Size([1000])), "rice", "fp32"))
    with pytest.raises(sc.PayloadError, match="exceeds the tensor size"):
        sc.decode(replace(parts, index_section=stream).assemble(), expect=1000)


@pytest.mark.parametrize(("codec", "numel"), [("rice(parameter=0)", 2**40), ("rice(parameter=4)", 2**40),
                                               ("rle", 2**48)])
def test_index_codecs_whose_stream_grows_with_the_gaps_refuse_rather_than_allocate_it(codec, numel):
    grad = sc.SparseGradient(torch.tensor([numel - 1]), torch.tensor([1.0]), torch.Size([numel]))
    tracemalloc.start()
    try:
        with pytest.raises(sc.SparseCommError, match="would take"):
            sc.encode(grad, codec)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    assert len(sc.encode(grad, "rice")) < 200  # its own parameter: a few bytes
