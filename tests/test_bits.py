"""Fixed-width bit packing: fields back to back, MSB first, exactly as ``np.packbits`` of each
field's bits would lay them out, for every width 1–64 and awkward counts."""

import numpy as np
import pytest

from sparsecomm.encode.bits import pack_fixed, unpack_fixed


def reference(values: np.ndarray, width: int) -> bytes:
    bits = [(int(v) >> (width - 1 - b)) & 1 for v in values for b in range(width)]
    return np.packbits(np.array(bits, dtype=np.uint8)).tobytes()


@pytest.mark.parametrize("width", range(1, 65))
@pytest.mark.parametrize("count", [1, 7, 8, 9, 23])
def test_fields_are_laid_out_msb_first_back_to_back(width, count):
    rng = np.random.default_rng(width * 100 + count)
    values = rng.integers(0, 2**63, size=count, dtype=np.uint64) >> np.uint64(max(0, 63 - width))
    values &= np.uint64((1 << width) - 1) if width < 64 else np.uint64(2**64 - 1)
    packed = pack_fixed(values, width)
    assert packed == reference(values, width)
    assert np.array_equal(unpack_fixed(packed, width, count), values)


def test_empty_and_zero_width():
    assert pack_fixed(np.zeros(0, dtype=np.uint64), 3) == b""
    assert unpack_fixed(b"", 3, 0).size == 0
    assert np.array_equal(unpack_fixed(b"", 0, 5), np.zeros(5, dtype=np.uint64))
