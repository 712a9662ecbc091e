"""Keep freed host memory in the process, so the host codecs' temporaries are not page-faulted in
afresh on every call.

glibc serves blocks above its mmap threshold with fresh mappings and returns the top of its heap
to the kernel once a little of it is free; every new page then costs a fault and a kernel clear on
first touch. A codec call builds a few arrays of 8 bytes per nonzero, so at 160k nonzeros each call
touched megabytes of new pages. With blocks below ``mmap_threshold`` served from the heap, and up to
``trim_threshold`` of freed heap kept, the next call reuses what the last one freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters"""
MAX_MMAP_THRESHOLD = 32 << 20
"""the largest mmap threshold glibc accepts on 64-bit systems"""
DEFAULT_TRIM_THRESHOLD = 128 << 20


def keep_freed_host_memory(mmap_threshold: int = MAX_MMAP_THRESHOLD,
                           trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Ask glibc's allocator to serve blocks below ``mmap_threshold`` bytes from its heap and keep
    up to ``trim_threshold`` bytes of freed heap instead of returning it to the kernel. Affects the
    whole process, so it is for processes sparsecomm starts (its workers and CLI) and for training
    scripts that opt in. Returns whether the allocator took both (False off glibc: macOS, Windows,
    musl)."""
    if not 0 <= mmap_threshold <= MAX_MMAP_THRESHOLD or not 0 <= trim_threshold < 2**31:
        raise ValueError(f"mmap_threshold must be in [0, {MAX_MMAP_THRESHOLD}] and trim_threshold in [0, 2**31), "
                         f"got {mmap_threshold} and {trim_threshold}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
