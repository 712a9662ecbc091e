"""The flat indices of |x| ≥ threshold on a GPU tensor: one Triton pass writes the mask, and
torch.nonzero compacts it.

torch's abs → ge → nonzero writes |x| as an N-sized float temporary and reads it back; here the
kernel reads x once and writes one byte per entry, so the pass moves 5 bytes per float32 entry
instead of 13. The threshold may be a device tensor, so no host round trip is needed to compute it;
the one left is nonzero's, which must learn how many passed. (Compacting in Triton instead —
count each block's hits, then write them after a cumulative sum of the counts — is slower.)

Imported through `sparsecomm.sparsify.base.gpu_kernels`, for CUDA tensors where Triton is installed
(PyTorch's CUDA builds ship it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192
"""entries per program"""


@triton.jit
def _mask_at_or_above(x_ptr, limit_ptr, mask_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(mask_ptr + offsets, tl.abs(x) >= tl.load(limit_ptr), mask=inside)


def indices_at_or_above(flat: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Ascending flat indices of ``flat`` (1-D, float32/16/bf16, on a GPU) with |x| ≥ ``threshold``
    (a number or a 0-d tensor; rounded to ``flat``'s dtype first, as torch's comparison would)."""
    flat = flat.detach().contiguous()
    numel = flat.numel()
    if numel == 0:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    limit = torch.as_tensor(threshold, device=flat.device).to(flat.dtype).to(torch.float32).reshape(1)
    mask = torch.empty(numel, dtype=torch.bool, device=flat.device)
    _mask_at_or_above[(triton.cdiv(numel, BLOCK),)](flat, limit, mask, numel, BLOCK=BLOCK, num_warps=8)
    return torch.nonzero(mask).squeeze(1)
