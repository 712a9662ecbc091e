"""Fixed-width bit packing: fields back to back, MSB first, exactly as ``np.packbits`` of each
field's bits would lay them out, for every width 1–64 and awkward counts; and in byte planes."""

import numpy as np
import pytest

from sparsecomm.encode.bits import nbytes_for_bits, pack_fixed, pack_planes, planes_nbytes, unpack_fixed, unpack_planes
from sparsecomm.errors import PayloadError


def reference(values: np.ndarray, width: int) -> bytes:
    bits = [(int(v) >> (width - 1 - b)) & 1 for v in values for b in range(width)]
    return np.packbits(np.array(bits, dtype=np.uint8)).tobytes()


def random_fields(width: int, count: int) -> np.ndarray:
    """``count`` random values below 2**width, as uint64."""
    rng = np.random.default_rng(width * 100 + count)
    values = rng.integers(0, 2**63, size=count, dtype=np.uint64) >> np.uint64(max(0, 63 - width))
    values &= np.uint64((1 << width) - 1) if width < 64 else np.uint64(2**64 - 1)
    return values


@pytest.mark.parametrize("width", range(1, 65))
@pytest.mark.parametrize("count", [1, 7, 8, 9, 23])
def test_fields_are_laid_out_msb_first_back_to_back(width, count):
    values = random_fields(width, count)
    packed = pack_fixed(values, width)
    assert packed == reference(values, width)
    assert np.array_equal(unpack_fixed(packed, width, count), values)


def test_empty_and_zero_width():
    assert pack_fixed(np.zeros(0, dtype=np.uint64), 3) == b""
    assert unpack_fixed(b"", 3, 0).size == 0
    assert np.array_equal(unpack_fixed(b"", 0, 5), np.zeros(5, dtype=np.uint64))


@pytest.mark.parametrize("width", range(0, 65))
@pytest.mark.parametrize("count", [1, 7, 8, 9, 23])
def test_byte_planes_round_trip_within_a_byte_of_one_stream(width, count):
    values = random_fields(width, count)
    packed = pack_planes(values, width)
    assert len(packed) == planes_nbytes(count, width)
    assert nbytes_for_bits(count * width) <= len(packed) <= nbytes_for_bits(count * width) + 1
    assert np.array_equal(unpack_planes(packed, width, count), values)


def test_byte_planes_hold_the_lowest_bytes_first_then_the_top_bits_back_to_back():
    values = np.array([0x1A2, 0x0FF, 0x301], dtype=np.uint64)  # 10 bits: a byte plane and a 2-bit plane
    assert pack_planes(values, 10) == bytes([0xA2, 0xFF, 0x01]) + pack_fixed(np.array([1, 0, 3]), 2)


def test_byte_planes_of_the_wrong_size_are_refused():
    packed = pack_planes(np.arange(10, dtype=np.uint64), 9)
    for wrong in (packed[:-1], packed + b"\0"):
        with pytest.raises(PayloadError, match="byte planes need 12 bytes"):
            unpack_planes(wrong, 9, 10)
