"""Host memory: a codec call's temporaries reuse the last call's pages, large buffers are
cleared through the C library's memset — to exactly zero, and only the tensor's own elements — and
entries are written into them by numpy exactly as ``index_copy_`` writes them."""

import subprocess
import sys

import pytest
import torch

from sparsecomm.host_memory import (
    MAX_MMAP_THRESHOLD,
    MEMSET,
    MEMSET_MIN_BYTES,
    clear_,
    keep_freed_host_memory,
    write_at,
)

FAULTS_PER_ROUND = """
import resource, numpy as np
from sparsecomm.host_memory import keep_freed_host_memory
assert keep_freed_host_memory()
def round_():  # three arrays of 8 bytes per entry at 160k entries, as a codec call builds
    a = np.ones(160_000); b = np.ones(160_000); c = a + b; del a, b, c
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc(), reason="mallopt is glibc's")
def test_freed_temporaries_are_reused_without_page_faults():
    # 3 × 1.25 MB of fresh pages would be about 940 faults a round
    faults = float(subprocess.run([sys.executable, "-c", FAULTS_PER_ROUND], check=True, capture_output=True,
                                  text=True).stdout)
    assert faults < 20


def test_out_of_range_settings_are_refused():
    with pytest.raises(ValueError, match="mmap_threshold"):
        keep_freed_host_memory(mmap_threshold=MAX_MMAP_THRESHOLD + 1)
    with pytest.raises(ValueError, match="trim_threshold"):
        keep_freed_host_memory(trim_threshold=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_a_large_buffer_is_cleared_to_exact_zeros(dtype):
    buffer = torch.full((MEMSET_MIN_BYTES // 2 + 3,), -7, dtype=dtype)  # 1-4 MB, not a round size
    assert clear_(buffer) is buffer
    assert torch.equal(buffer.view(torch.uint8), torch.zeros(buffer.numel() * buffer.element_size(), dtype=torch.uint8))


def test_memset_clears_only_the_tensors_own_bytes():
    if MEMSET is None:
        pytest.skip("no C library to load")
    storage = torch.full((3 * MEMSET_MIN_BYTES // 4,), 5.0)
    middle = storage[MEMSET_MIN_BYTES // 8: 5 * MEMSET_MIN_BYTES // 8]  # 2 MB inside a 3 MB storage
    clear_(middle)
    assert bool((middle == 0).all())
    before, after = storage[: MEMSET_MIN_BYTES // 8], storage[5 * MEMSET_MIN_BYTES // 8:]
    assert bool((before == 5).all()) and bool((after == 5).all())


@pytest.mark.parametrize("make", [lambda: torch.ones(MEMSET_MIN_BYTES // 2, 2).t(),  # strided: not one span
                                  lambda: torch.ones(8)])  # small: torch's zero_
def test_buffers_memset_cannot_or_need_not_clear_are_zeroed_by_torch(make):
    tensor = make()
    base = tensor._base if tensor._base is not None else tensor
    clear_(tensor)
    assert bool((tensor == 0).all()) and bool((base == 0).all())


def test_a_buffer_saved_for_backward_and_then_cleared_is_refused_by_autograd_as_after_zero_():
    weight = torch.ones(3, requires_grad=True)
    buffer = torch.ones(MEMSET_MIN_BYTES // 4, 3)
    product = (buffer * weight).sum()  # saves buffer for weight's gradient
    clear_(buffer)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_entries_are_written_as_index_copy_writes_them_and_nowhere_else(dtype):
    generator = torch.Generator().manual_seed(0)
    storage = torch.full((1000,), 7.0, dtype=dtype)
    target = storage[100:900]  # a view inside a larger buffer: written at its own offset
    indices = torch.randperm(800, generator=generator)[:300]
    values = torch.randn(300, generator=generator, dtype=torch.float64)  # cast to the target's dtype
    expected = target.clone().index_copy_(0, indices, values.to(dtype))
    write_at(target, indices, values)
    assert torch.equal(target, expected)
    assert bool((storage[:100] == 7).all()) and bool((storage[900:] == 7).all())


@pytest.mark.parametrize("bad", [-1, 800])
def test_an_index_outside_the_target_is_refused_not_wrapped(bad):
    target = torch.zeros(800)
    with pytest.raises(IndexError):
        write_at(target, torch.tensor([3, bad]), torch.ones(2))
    assert bool((target[-1:] == 0).all())


def test_a_buffer_saved_for_backward_and_then_written_is_refused_by_autograd():
    weight = torch.ones(3, requires_grad=True)
    buffer = torch.ones(300)
    product = (buffer.view(100, 3) * weight).sum()
    write_at(buffer, torch.tensor([5]), torch.tensor([2.0]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.backward()
