"""``sketch_allreduce``: S2 Reducer — a count sketch plus a block bitmap, both summable by a dense
all_reduce, so sparse gradients are reduced with the dense collective's efficiency.

Each rank inserts its nonzeros into an r×c count sketch, S[j, h_j(i)] += s_j(i)·g(i), and marks
their blocks in a bitmap. The sketches are summed (all_reduce SUM), the bitmaps OR-ed (all_reduce
BOR). The bitmap tells every rank which entries are nonzero; ``decode`` reads their values:

- ``median`` (the paper's): each entry is median_j s_j(i)·S[j, h_j(i)]. Not exact: what the
  collisions added to or took from this rank's contribution (its own sketch read at the marked
  entries, against what it put in) comes back as the call's ``lost``, for the feedback to send
  again; summed over ranks it is exactly what the sum lost with one row (with several, the median
  is not linear, and each rank gets its own read's error). Only while it is smaller than what the
  rank sent: a sketch narrower than that (λ below about the number of ranks) adds more noise than
  signal, and sent again it would compound step by step; it is then dropped, as the paper does.
- ``peel``: since the bitmap names the unknowns, the sketch is a sparse linear system, solved by
  peeling as an invertible Bloom lookup table is: an entry alone in one of its cells is read
  exactly, subtracted from its other rows' cells, and so on. With three rows this solves every
  entry once the sketch has about 1.23 cells per marked entry; entries left unsolved are delivered
  as zero and every rank keeps its own share of them (``lost``). Exact up to float rounding.

The sketch holds ``ratio`` (λ) × nnz cells. ``median``: nnz is the largest on any rank, as in the
paper, whose best λ is 0.5 (its noise then grows with the ranks: each read sums about P/λ
entries). ``peel``: nnz is the entries of the ranks' marked blocks summed, the most the unknowns
can be; λ ≈ 1.3 solves them all with three rows (less where the ranks' selections overlap, as
embedding rows do). Neither is capped at the dense tensor's size.

Hashes are degree-3 polynomials modulo 2^31 − 1 (a 4-wise independent family for indices below
2^31 − 1) with coefficients drawn from ``seed``, the step and the call number, so every rank
hashes alike and no two entries collide call after call. Sketch and bitmap are built and read on
the gradient's device and cross to the wire's only when the backend needs it (gloo, CUDA
gradients); NCCL has no bitwise OR, so there the bitmaps are gathered and folded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.base import TRANSPORTS, Transport, as_sparse, deliver, output_buffer, refused_unless_out_fits
from sparsecomm.transport.collectives import Group, all_reduce_or, fingerprint, on_wire, wire_device
from sparsecomm.transport.request import Agreement, CallRecord, Reduction, Request
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
    decode: str = "median"
    exact = False

    def __post_init__(self) -> None:
        if self.ratio <= 0 or self.rows < 1 or self.block < 1:
            raise SparseCommError("sketch_allreduce needs ratio > 0, rows >= 1, block >= 1")
        if self.decode not in DECODES:
            raise SparseCommError(f"sketch_allreduce decode must be one of {', '.join(DECODES)}, not {self.decode!r}")

    def columns(self, agreement: Agreement) -> int:
        """Cells per row: λ × the largest nnz (``median``) or × the ranks' marked entries summed
        (``peel``: what the agreement step carried for it)."""
        nnz = agreement.total_nnz if self.decode == "peel" else agreement.max_nnz
        return max(1, math.ceil(self.ratio * max(nnz, 1) / self.rows))

    def reduce(self, grad: SparseGradient | torch.Tensor, group: Group = None, request: Request | None = None,
               out: torch.Tensor | None = None, session: TransportSession | None = None) -> Reduction:
        sparse = as_sparse(grad)
        request = request or Request()
        numel = sparse.numel
        if numel >= PRIME:
            raise SparseCommError(f"sketch_allreduce hashes indices below {PRIME}; tensor has {numel}")
        config = fingerprint(self.to_spec(), tuple(sparse.shape), sparse.dtype)
        record = CallRecord(self.to_spec())
        n_blocks = -(-numel // self.block)
        device, wire = sparse.device, wire_device(group)
        indices = sparse.indices
        with record.phase("encode"):
            marks = torch.zeros(n_blocks, dtype=torch.bool, device=device)
            marks[indices // self.block] = True
            # peeling solves for every marked entry: this rank's count of them sizes the sketch
            unknowns = min(int(marks.sum()) * self.block, numel) if self.decode == "peel" else sparse.nnz
        request = refused_unless_out_fits(request, out, numel, sparse.dtype)
        with record.phase("agreement"):
            record.agreement = agree(group, request, numel, config, unknowns)
        columns = self.columns(record.agreement)
        # new hashes every call, so that no two entries collide call after call (a custom loop's
        # calls between steps share a step)
        hashes = SketchHashes(hash_seed(self.seed, request.step, request.call), self.rows)
        with record.phase("encode"):
            values = sparse.values.detach().to(torch.float32)
            sketch = torch.zeros(self.rows, columns, dtype=torch.float32, device=device)
            buckets, signs = hashes.buckets_and_signs(indices, columns)
            for row in range(self.rows):
                sketch[row].index_add_(0, buckets[row], signs[row].to(torch.float32) * values)
            own = sketch.clone() if self.decode == "median" else None  # the all_reduce sums in place
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
            signs = out_signs.to(torch.float32)
            mine = torch.searchsorted(positions, indices)  # own entries lie in marked blocks
            if self.decode == "peel":
                decoded, solved = peel(sketch, out_buckets, signs)
                contracts = not bool(solved.all())  # what it leaves is what the ranks sent of it
                lost = torch.zeros_like(decoded).index_add_(0, mine, values).masked_fill_(solved, 0.0)
            else:
                assert own is not None
                decoded = median_read(sketch, out_buckets, signs)
                lost = median_read(own, out_buckets, signs).neg_().index_add_(0, mine, values)
                contracts = bool(lost.square().sum() < values.square().sum())
        with record.phase("output"):
            total = output_buffer(out, numel, sparse.dtype, device)
            total[positions] = decoded.to(sparse.dtype)
            kept = SparseGradient(positions, lost.to(sparse.dtype), torch.Size([numel])) if contracts else None
            return Reduction(deliver(total, sparse.shape, sparse.device, out), record, lost=kept)


DECODES = ("median", "peel")


def hash_seed(*words: int) -> int:
    """One seed for a call's hashes from its words (the transport's seed, step, call number)."""
    entropy = [word % (1 << 64) for word in words]  # a negative seed as its two's complement
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def median_read(sketch: torch.Tensor, buckets: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Each entry's value read from ``sketch``: the median over rows of s_j(i)·S[j, h_j(i)]."""
    estimates = torch.gather(sketch, 1, buckets) * signs
    # the lower median, as torch.median's, by a sort: a median with indices on CUDA is one of the
    # operations deterministic algorithms refuse
    return estimates.sort(dim=0).values[(estimates.shape[0] - 1) // 2] if estimates.shape[0] > 1 else estimates[0]


def peel(sketch: torch.Tensor, buckets: torch.Tensor, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``sketch`` (rows × columns, the sum of every rank's) for the values of the entries
    hashed to ``buckets`` with ``signs`` (rows × entries): every round reads each unsolved entry
    that sits alone in one of its cells and takes it out of all its cells. Returns (values, solved),
    unsolved entries at zero. One host read per round; each round works on the entries still
    unsolved, and most are solved in the first few. A sketch off the host is peeled on the host: a
    GPU's atomic additions take a cell's repeated entries in no fixed order, and every rank, peeling
    the same sketch on its own, must reach the same bits."""
    if sketch.device.type != "cpu":
        values, solved = peel(sketch.cpu(), buckets.cpu(), signs.cpu())
        return values.to(sketch.device), solved.to(sketch.device)
    rows, count = buckets.shape
    remaining = sketch.clone().view(-1)
    # entries × rows: an entry's flat cell ids and signs side by side
    cells = (buckets + torch.arange(rows, device=buckets.device)[:, None] * sketch.shape[1]).t().contiguous()
    signs = signs.t().contiguous()
    load = torch.zeros_like(remaining).index_add_(0, cells.view(-1), torch.ones_like(signs).view(-1))
    values = torch.zeros(count, dtype=remaining.dtype, device=remaining.device)
    solved = torch.zeros(count, dtype=torch.bool, device=remaining.device)
    unsolved = torch.arange(count, device=buckets.device)
    while unsolved.numel():
        alone = load.index_select(0, cells.view(-1)).view(cells.shape) == 1
        found = alone.any(dim=1)
        ready = torch.nonzero(found).squeeze(1)
        if ready.numel() == 0:  # a core no cell singles out: left to the feedback
            break
        ready_cells, ready_signs = cells.index_select(0, ready), signs.index_select(0, ready)
        ready_alone = alone.index_select(0, ready)
        reads = remaining.index_select(0, ready_cells.view(-1)).view(ready_cells.shape) * ready_signs
        read = reads[:, -1]
        for row in range(rows - 2, -1, -1):  # the value from a cell that holds the entry alone
            read = torch.where(ready_alone[:, row], reads[:, row], read)
        entries = unsolved.index_select(0, ready)
        values.index_copy_(0, entries, read)
        solved.index_fill_(0, entries, True)
        remaining.index_add_(0, ready_cells.view(-1), (ready_signs * read[:, None]).view(-1), alpha=-1)
        load.index_add_(0, ready_cells.view(-1), torch.ones_like(ready_signs).view(-1), alpha=-1)
        left = torch.nonzero(~found).squeeze(1)
        unsolved, cells, signs = (kept.index_select(0, left) for kept in (unsolved, cells, signs))
    return values, solved
