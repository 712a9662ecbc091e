"""`SparseGradient`: the one value passed between sparsify, feedback, encode and decode."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.host_memory import write_at

TORCH_RADIX_SORT_MIN = 1 << 15
"""torch sorts a CPU integer tensor of at least this many elements by radix; below it, two radix
passes over 16-bit digits in numpy are faster"""


@dataclass(frozen=True)
class SparseGradient:
    """Nonzero entries of a tensor of ``shape``: flat int64 ``indices`` into the row-major layout and
    their ``values``. Indices need not be sorted; they must be unique and inside ``[0, numel)``
    (`validate` checks; `encode` refuses any that are not).

    Every stage passes one: a sparsifier selects one from a dense gradient, the codecs encode one,
    `decode` returns one. Frozen: stages make new ones rather than change them.

    Args:
        indices: 1-D flat positions (converted to int64).
        values: 1-D values, one per index.
        shape: the dense tensor's shape.

    Raises:
        SparseCommError: ``indices`` and ``values`` are not 1-D or differ in length.

    Example:
        ```python
        import torch

        import sparsecomm as sc

        grad = sc.SparseGradient(torch.tensor([5, 0]), torch.tensor([2.0, -1.0]), torch.Size([2, 3]))
        print(grad.nnz, grad.density, grad.sorted().indices.tolist())
        print(grad.to_dense())             # [[-1, 0, 0], [0, 0, 2]]
        assert torch.equal(sc.SparseGradient.from_dense(grad.to_dense()).to_dense(), grad.to_dense())
        ```
    """

    indices: torch.Tensor
    values: torch.Tensor
    shape: torch.Size

    def __post_init__(self) -> None:
        if self.indices.dim() != 1 or self.values.dim() != 1:
            raise SparseCommError("indices and values must be 1-D tensors")
        if self.indices.numel() != self.values.numel():
            raise SparseCommError(
                f"{self.indices.numel()} indices but {self.values.numel()} values"
            )
        if self.indices.dtype != torch.int64:
            object.__setattr__(self, "indices", self.indices.to(torch.int64))
        if not isinstance(self.shape, torch.Size):
            object.__setattr__(self, "shape", torch.Size(self.shape))

    # -- properties ---------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """The dense tensor's number of elements."""
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        """The number of entries held."""
        return self.indices.numel()

    @property
    def dtype(self) -> torch.dtype:
        """The values' dtype."""
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        """The values' device."""
        return self.values.device

    @property
    def density(self) -> float:
        """nnz / numel (0 for an empty tensor)."""
        return self.nnz / self.numel if self.numel else 0.0

    # -- conversions --------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> SparseGradient:
        """All nonzero entries of ``tensor``.

        Args:
            tensor: a dense tensor of any shape.

        Returns:
            Its nonzero entries, in index order, with its shape.
        """
        flat = tensor.reshape(-1)
        indices = torch.nonzero(flat).squeeze(1)
        return cls(indices, flat[indices], tensor.shape)

    @classmethod
    def from_sparse_coo(cls, tensor: torch.Tensor) -> SparseGradient:
        """From a torch sparse COO tensor (coalesced first, so duplicates are summed); values of a
        hybrid tensor (dense trailing dims, as from ``nn.Embedding(sparse=True)``) are flattened.

        Args:
            tensor: a sparse COO tensor.

        Returns:
            Its entries, with flat indices into its dense shape.

        Raises:
            SparseCommError: ``tensor`` is not a sparse COO tensor.
        """
        if not tensor.is_sparse:
            raise SparseCommError("expected a sparse COO tensor")
        coo = tensor.coalesce()
        sparse_dims = coo.sparse_dim()
        shape = coo.shape
        strides = torch.tensor(
            [math.prod(shape[d + 1 : sparse_dims]) for d in range(sparse_dims)], dtype=torch.int64
        ).to(coo.device)
        row_offsets = (coo.indices() * strides[:, None]).sum(0)
        dense_block = math.prod(shape[sparse_dims:])
        flat = row_offsets[:, None] * dense_block + torch.arange(dense_block, device=coo.device)
        return cls(flat.reshape(-1), coo.values().reshape(-1), shape)

    def to_dense(self) -> torch.Tensor:
        """A dense tensor of ``shape`` on the values' device: the entries, zero elsewhere."""
        return write_at(torch.zeros(self.numel, dtype=self.dtype, device=self.device), self.indices,
                        self.values).reshape(self.shape)

    def to_sparse_coo(self) -> torch.Tensor:
        """A coalesced sparse COO tensor with one sparse dimension per dimension of ``shape``."""
        if len(self.shape) == 0:
            coords = self.indices.reshape(0, -1)
        else:
            coords = torch.stack(torch.unravel_index(self.indices, self.shape))
        return torch.sparse_coo_tensor(coords, self.values, self.shape, check_invariants=True).coalesce()

    def sorted(self) -> SparseGradient:
        """The same entries with indices in ascending order (``self`` when they already are, as a
        threshold's selection is: one comparison pass instead of a sort and two gathers)."""
        if self.nnz < 2 or _strictly_increasing(self.indices):
            return self
        if self.indices.device.type == "cpu" and self.nnz < TORCH_RADIX_SORT_MIN and self.numel <= 1 << 32:
            return self._sorted_by_16_bit_digits()
        # 32-bit keys where they fit: torch's radix sort makes half the passes of int64 keys
        keys = self.indices.to(torch.int32) if self.numel <= 1 << 31 else self.indices
        ordered, order = torch.sort(keys)
        return SparseGradient(ordered.to(torch.int64), _gathered(self.values, order), self.shape)

    def _sorted_by_16_bit_digits(self) -> SparseGradient:
        """Sorted by two stable numpy sorts of 16-bit digits, low then high: numpy sorts 16-bit keys
        by radix, the same code on every processor (its sort of wider integers is SIMD code whose
        speed differs several times between processors), and below torch's radix-sort size this
        beats torch's comparison sort."""
        indices = self.indices.numpy()
        by_low = np.argsort((indices & 0xFFFF).astype(np.uint16), kind="stable")
        order = by_low[np.argsort((indices[by_low] >> 16).astype(np.uint16), kind="stable")]
        return SparseGradient(torch.from_numpy(indices[order]), _gathered(self.values, torch.from_numpy(order)),
                              self.shape)

    def to(self, device: torch.device | str) -> SparseGradient:
        """The same entries with indices and values on ``device``."""
        return SparseGradient(self.indices.to(device), self.values.to(device), self.shape)

    def to_host(self) -> SparseGradient:
        """The same entries on the CPU, where the host codecs read them: ``self`` when already
        there, else one device-to-host copy of indices and values packed together, into pinned
        memory (the copy every host codec costs a GPU gradient, and its one synchronisation)."""
        if self.values.device.type == "cpu" and self.indices.device.type == "cpu":
            return self
        index_bytes = self.nnz * 8
        packed = torch.cat([self.indices.contiguous().view(torch.uint8),
                            self.values.detach().contiguous().view(torch.uint8)])
        host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        host.copy_(packed)
        return SparseGradient(host[:index_bytes].view(torch.int64), host[index_bytes:].view(self.dtype), self.shape)

    def validate(self) -> None:
        """Raise `SparseCommError` unless indices are in range and unique."""
        if self.nnz == 0:
            return
        lo, hi = int(self.indices.min()), int(self.indices.max())
        if lo < 0 or hi >= self.numel:
            raise SparseCommError(f"index out of range, outside [0, {self.numel}): saw {lo}..{hi}")
        if _strictly_increasing(self.indices):  # sorted, as a selection is: no sort to find a repeat
            return
        ordered = torch.sort(self.indices).values
        duplicate = ordered[1:] == ordered[:-1]
        if bool(duplicate.any()):
            first = int(ordered[1:][duplicate][0])
            raise SparseCommError(f"duplicate index {first}: an index repeats, where a sparse gradient holds each once")

    def __repr__(self) -> str:
        return (
            f"SparseGradient(shape={tuple(self.shape)}, nnz={self.nnz}, dtype={self.dtype}, "
            f"device={self.device})"
        )


def _gathered(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``values[order]``; on the CPU by numpy where it can (a third to a half of torch's time at
    16k–160k entries), else by torch (bfloat16, autograd, other devices)."""
    if values.device.type == "cpu" and order.device.type == "cpu" and values.dtype != torch.bfloat16 \
            and not values.requires_grad:
        return torch.from_numpy(values.numpy()[order.numpy()])
    return values[order]


def _strictly_increasing(indices: torch.Tensor) -> bool:
    """On the CPU through numpy, several times faster than torch's compare and reduce at these
    sizes (the host codecs check every selection they encode)."""
    if indices.device.type == "cpu":
        ordered = indices.numpy()
        return bool((ordered[1:] > ordered[:-1]).all())
    return bool((indices[1:] > indices[:-1]).all())


def nonzero_rows(dense: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """A coalesced sparse COO tensor of ``dense``'s nonzero slices over its first ``sparse_dim``
    dimensions — what ``dense.to_sparse(sparse_dim)`` returns, built from one reduction and one
    row gather (torch's conversion costs tens of µs per row on CPU). A row is nonzero where its
    largest magnitude is (NaN included, −0.0 not, as ``!= 0`` decides): on the host that reduction
    is ten times faster than ``(rows != 0).any(1)``."""
    leading = dense.shape[:sparse_dim]
    flat = dense.reshape(math.prod(leading), -1)
    if flat.shape[1] == 0:
        rows = torch.zeros(0, dtype=torch.int64, device=dense.device)
    else:
        rows = (flat.abs().amax(1) != 0).nonzero().squeeze(1)
    indices = torch.stack(torch.unravel_index(rows, leading)) if sparse_dim > 1 else rows[None]
    values = flat.index_select(0, rows).reshape((len(rows), *dense.shape[sparse_dim:]))
    return torch.sparse_coo_tensor(indices, values, dense.shape, is_coalesced=True, check_invariants=False)
