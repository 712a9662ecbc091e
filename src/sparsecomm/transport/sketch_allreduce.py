"""``sketch_allreduce``: S2 Reducer — a count sketch plus a block bitmap, both summable by a dense
all_reduce, so sparse gradients are reduced with the dense collective's efficiency.

Each rank inserts its nonzeros into an r×c count sketch, S[j, h_j(i)] += s_j(i)·g(i), and marks
their blocks in a bitmap. The sketches are summed (all_reduce SUM), the bitmaps OR-ed (all_reduce
BOR). Every entry of a marked block is decoded as median_j s_j(i)·S[j, h_j(i)]. The sketch holds
``ratio`` (λ) × nnz cells (nnz: the largest on any rank; the paper's best λ is 0.5). With one row
the estimate is unbiased; more rows trade a small bias for robustness. Hashes are degree-3
polynomials modulo 2^31 − 1 (a 4-wise independent family for indices below 2^31 − 1) with
coefficients drawn from ``seed``, so every rank hashes alike. Sketch and bitmap are built and read
on the gradient's device and cross to the wire's only when the backend needs it (gloo, CUDA
gradients); NCCL has no bitwise OR, so there the bitmaps are gathered and folded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.base import TRANSPORTS, Transport, as_sparse, deliver, output_buffer
from sparsecomm.transport.collectives import Group, all_reduce_or, fingerprint, on_wire, wire_device
from sparsecomm.transport.request import CallRecord, Reduction, Request
from sparsecomm.transport.session import TransportSession

PRIME = (1 << 31) - 1
HASH_CHUNK = 1 << 15


def mod_prime(x: torch.Tensor) -> torch.Tensor:
    """x mod (2^31 − 1) for 0 ≤ x < 2^62 by folding the high bits (shifts and adds, no division)."""
    x = (x & PRIME) + (x >> 31)
    x = (x & PRIME) + (x >> 31)
    return torch.where(x >= PRIME, x - PRIME, x)


def polynomial_hash(indices: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """Σ a_d x^d mod (2^31 − 1) by Horner's rule; every product stays below 2^62."""
    x = mod_prime(indices)
    acc = torch.full_like(x, int(coefficients[0]))
    for coefficient in coefficients[1:].tolist():
        acc = mod_prime(acc * x + coefficient)
    return acc


BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_bits(marks: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, most significant bit first (numpy's ``packbits``), on its device."""
    padded = torch.zeros(-(-marks.numel() // 8) * 8, dtype=torch.uint8, device=marks.device)
    padded[: marks.numel()] = marks
    weights = torch.tensor(BIT_WEIGHTS, dtype=torch.uint8, device=marks.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bits of ``packed`` (`pack_bits`'s layout) as a bool vector."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).view(-1)[:count].bool()


@dataclass(frozen=True)
class SketchHashes:
    """Bucket and sign hash functions for ``rows`` rows, derived from ``seed``."""

    seed: int
    rows: int

    def coefficients(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randint(1, PRIME, (self.rows, 2, 4), generator=generator, dtype=torch.int64)

    def buckets_and_signs(self, indices: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows × n bucket indices in [0, columns), rows × n signs ±1). Computed in cache-sized
        chunks: the ~40 elementwise steps then stay in cache instead of streaming memory."""
        coefficients = self.coefficients().to(indices.device)
        count = indices.numel()
        buckets = torch.empty(self.rows, count, dtype=torch.int64, device=indices.device)
        signs = torch.empty(self.rows, count, dtype=torch.int64, device=indices.device)
        for start in range(0, count, HASH_CHUNK):
            chunk = indices[start : start + HASH_CHUNK]
            for row in range(self.rows):
                # multiply-shift maps a hash below 2^31 onto [0, columns) without a division
                hashed = polynomial_hash(chunk, coefficients[row, 0])
                buckets[row, start : start + HASH_CHUNK] = (hashed * columns) >> 31
                signs[row, start : start + HASH_CHUNK] = (polynomial_hash(chunk, coefficients[row, 1]) & 1) * 2 - 1
        return buckets, signs


@TRANSPORTS.register("sketch_allreduce")
@dataclass(frozen=True)
class SketchAllreduce(Transport):
    ratio: float = 0.5
    rows: int = 1
    block: int = 1
    seed: int = 0
    exact = False

    def __post_init__(self) -> None:
        if self.ratio <= 0 or self.rows < 1 or self.block < 1:
            raise SparseCommError("sketch_allreduce needs ratio > 0, rows >= 1, block >= 1")

    def columns(self, max_nnz: int) -> int:
        return max(1, math.ceil(self.ratio * max(max_nnz, 1) / self.rows))

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        sparse = as_sparse(grad)
        request = request or Request()
        numel = sparse.numel
        if numel >= PRIME:
            raise SparseCommError(f"sketch_allreduce hashes indices below {PRIME}; tensor has {numel}")
        config = fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype)
        record = CallRecord(self.to_spec())
        with record.phase("agreement"):
            record.agreement = agree(group, request, numel, config, sparse.nnz)
            max_nnz = record.agreement.max_nnz
        columns = self.columns(max_nnz)
        hashes = SketchHashes(self.seed + request.step, self.rows)
        n_blocks = -(-numel // self.block)
        device, wire = sparse.device, wire_device(group)
        with record.phase("encode"):
            indices = sparse.indices
            values = sparse.values.detach().to(torch.float32)
            sketch = torch.zeros(self.rows, columns, dtype=torch.float32, device=device)
            buckets, signs = hashes.buckets_and_signs(indices, columns)
            for row in range(self.rows):
                sketch[row].index_add_(0, buckets[row], signs[row].to(torch.float32) * values)
            marks = torch.zeros(n_blocks, dtype=torch.bool, device=device)
            marks[indices // self.block] = True
            sketch, bitmap = on_wire(sketch, wire), on_wire(pack_bits(marks), wire)
        with record.phase("transfer"):
            dist.all_reduce(sketch, op=dist.ReduceOp.SUM, group=group)
            all_reduce_or(bitmap, group)
        record.bytes_sent = sketch.numel() * 4 + bitmap.numel()
        with record.phase("decode"):
            sketch, bitmap = sketch.to(device), bitmap.to(device)
            marked = torch.nonzero(unpack_bits(bitmap, n_blocks)).squeeze(1)
            positions = (marked[:, None] * self.block + torch.arange(self.block, device=device)).reshape(-1)
            positions = positions[positions < numel]
            out_buckets, out_signs = hashes.buckets_and_signs(positions, columns)
            estimates = torch.gather(sketch, 1, out_buckets) * out_signs.to(torch.float32)
            decoded = estimates.median(dim=0).values if self.rows > 1 else estimates[0]
        with record.phase("output"):
            total = output_buffer(out, numel, sparse.dtype, device)
            total[positions] = decoded.to(sparse.dtype)
            return Reduction(deliver(total, sparse.shape, sparse.device, out), record)
