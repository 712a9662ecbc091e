"""Host memory: keep what the process freed, so the host codecs' temporaries are not page-faulted
in afresh on every call (`keep_freed_host_memory`), and clear large buffers at memory speed
(`clear_`) and write entries into them at numpy's speed (`write_at`).

glibc serves blocks above its mmap threshold with fresh mappings and returns the top of its heap
to the kernel once a little of it is free; every new page then costs a fault and a kernel clear on
first touch. A codec call builds a few arrays of 8 bytes per nonzero, so at 160k nonzeros each call
would touch megabytes of new pages. With blocks below ``mmap_threshold`` served from the heap, and up to
``trim_threshold`` of freed heap kept, the next call reuses what the last one freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from typing import Any

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters"""
MAX_MMAP_THRESHOLD = 32 << 20
"""the largest mmap threshold glibc accepts on 64-bit systems"""
DEFAULT_TRIM_THRESHOLD = 128 << 20
MEMSET_MIN_BYTES = 1 << 20
"""below this, torch's own zero_, as fast here: memset gains only on buffers beyond the cache,
which it writes with streaming stores"""


def _c_function(name: str, argtypes: list[Any], restype: Any) -> Callable[..., Any] | None:
    """The C library's function ``name``, typed; None where there is no C library to load or it
    lacks the function."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


MEMSET = _c_function("memset", [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], ctypes.c_void_p)
"""loaded once: a ctypes function, read-only"""


def clear_(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.zero_()``, faster for contiguous host buffers larger than the cache: the C library's
    memset writes them with streaming stores, which neither read each line before writing it nor
    evict the cache the codecs work in (a 64 MB sum buffer clears in under half the time). Like
    zero_, it counts as an in-place change for autograd; a tensor that requires grad gets zero_."""
    nbytes = tensor.numel() * tensor.element_size()
    if (MEMSET is None or tensor.device.type != "cpu" or nbytes < MEMSET_MIN_BYTES or not tensor.is_contiguous()
            or tensor.requires_grad):
        return tensor.zero_()
    MEMSET(tensor.data_ptr(), 0, nbytes)
    torch.autograd.graph.increment_version(tensor)
    return tensor


def write_at(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``target[indices] = values`` for a flat ``target`` (values cast to its dtype, indices inside
    it: a negative one is refused, not wrapped). On the host by numpy's indexed assignment, which
    writes scattered entries into a large buffer faster than torch's ``index_copy_``; elsewhere, and
    for dtypes numpy lacks or where autograd is involved, by ``index_copy_``. Like it, counts as an
    in-place change for autograd."""
    if (target.device.type != "cpu" or indices.device.type != "cpu" or values.device.type != "cpu"
            or indices.dtype != torch.int64
            or target.dtype == torch.bfloat16 or target.requires_grad or values.requires_grad
            or not target.is_contiguous()):
        return target.index_copy_(0, indices.to(target.device), values.to(target.device, target.dtype))
    if indices.numel() and int(indices.min()) < 0:
        raise IndexError(f"index {int(indices.min())} is negative")
    target.numpy()[indices.numpy()] = values.to(target.dtype).numpy()
    torch.autograd.graph.increment_version(target)
    return target


def keep_freed_host_memory(mmap_threshold: int = MAX_MMAP_THRESHOLD,
                           trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Ask glibc's allocator to serve blocks below ``mmap_threshold`` bytes from its heap and keep
    up to ``trim_threshold`` bytes of freed heap instead of returning it to the kernel.

    The host codecs build temporaries of a few bytes per nonzero on every call; kept, the next call
    reuses what the last one freed instead of page-faulting fresh memory in (a 160k-nonzero Rice
    encode: 1.0 ms instead of 3.7). Affects the whole process, so it is for processes sparsecomm
    starts (its workers and CLI) and for training scripts that opt in: call it once, at the start.

    Args:
        mmap_threshold: blocks smaller than this many bytes come from the heap (at most 32 MiB,
            glibc's largest).
        trim_threshold: up to this many bytes of freed heap are kept (below 2**31).

    Returns:
        Whether the allocator took both settings; False off Linux or where the C library is not
        glibc (macOS, Windows, musl).

    Raises:
        ValueError: a threshold out of range.

    Example:
        ```python
        import sparsecomm as sc

        if not sc.keep_freed_host_memory():
            print("not glibc: the allocator keeps its own counsel")
        ```
    """
    if not 0 <= mmap_threshold <= MAX_MMAP_THRESHOLD or not 0 <= trim_threshold < 2**31:
        raise ValueError(f"mmap_threshold must be in [0, {MAX_MMAP_THRESHOLD}] and trim_threshold in [0, 2**31), "
                         f"got {mmap_threshold} and {trim_threshold}")
    if not sys.platform.startswith("linux"):
        return False
    mallopt = _c_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
