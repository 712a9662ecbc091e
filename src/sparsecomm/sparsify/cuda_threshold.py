"""DGC's sampled threshold on a GPU tensor in two Triton launches, without leaving the device.

torch's way (gather a strided sample, abs, top-k of it, min) is a dozen launches, most of them
top-k's radix passes. Here one kernel counts the sampled magnitudes into 65,536 bins keyed by the
top 16 bits of their float32 pattern (exponent and 8 mantissa bits: bins 0.4% wide, ordered like
the magnitudes), and one program walks the bins down from the largest until ``top`` samples are
counted. The threshold is that bin's lower edge: the ``top``-th largest sample rounded down to 8
significant bits, so a few more entries than the exact sample top-k would keep pass it.

Imported through `sparsecomm.sparsify.base.gpu_kernels`, for CUDA tensors where Triton is installed
(PyTorch's CUDA builds ship it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_SHIFT = 15
"""float32 bits dropped below the key: 31 − 15 = 16 bits of |x| (8 exponent, 8 mantissa)"""
BINS = 1 << (31 - KEY_SHIFT)
SAMPLE_BLOCK = 4096
SCAN_CHUNK = 2048


@triton.jit
def _sample_histogram(x_ptr, start_ptr, hist_ptr, count, stride, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    taken = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = taken < count
    x = tl.load(x_ptr + tl.load(start_ptr) + taken * stride, mask=inside, other=0.0).to(tl.float32)
    keys = tl.abs(x).to(tl.int32, bitcast=True) >> SHIFT
    tl.atomic_add(hist_ptr + keys, tl.full(keys.shape, 1, tl.int32), mask=inside)


@triton.jit
def _lower_edge_of_top(hist_ptr, top, out_ptr, SHIFT: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr):
    # chunks of bins from the largest down: their totals find the chunk where ``top`` is reached,
    # and one scan inside it the bin
    lanes = tl.arange(0, CHUNK)
    above = tl.sum(tl.zeros([CHUNK], tl.int32), axis=0)  # samples in the chunks walked so far
    chosen, before = above - 1, above
    for chunk in range(BINS // CHUNK):
        total = tl.sum(tl.load(hist_ptr + BINS - 1 - chunk * CHUNK - lanes), axis=0)
        reached = (above < top) & (above + total >= top)
        chosen = tl.where(reached, chunk, chosen)
        before = tl.where(reached, above, before)
        above += total
    bins = BINS - 1 - chosen * CHUNK - lanes  # descending
    counted = before + tl.cumsum(tl.load(hist_ptr + bins), axis=0)
    first = tl.min(tl.where(counted >= top, lanes, CHUNK), axis=0)
    tl.store(out_ptr, ((BINS - 1 - chosen * CHUNK - first) << SHIFT).to(tl.float32, bitcast=True))


def top_sample_lower_edge(flat: torch.Tensor, start: torch.Tensor, count: int, stride: int, top: int) -> torch.Tensor:
    """A 0-d float32 tensor on ``flat``'s device (1-D, float32/16/bf16, on a GPU): the ``top``-th
    largest magnitude of the ``count`` entries ``start + i·stride`` (``start``: a 1-element int64
    tensor there), rounded down to 8 significant bits."""
    flat = flat.detach().contiguous()
    hist = torch.zeros(BINS, dtype=torch.int32, device=flat.device)
    _sample_histogram[(triton.cdiv(count, SAMPLE_BLOCK),)](flat, start, hist, count, stride, SHIFT=KEY_SHIFT,
                                                          BLOCK=SAMPLE_BLOCK, num_warps=8)
    threshold = torch.empty(1, dtype=torch.float32, device=flat.device)
    _lower_edge_of_top[(1,)](hist, top, threshold, SHIFT=KEY_SHIFT, BINS=BINS, CHUNK=SCAN_CHUNK, num_warps=4)
    return threshold.reshape(())
