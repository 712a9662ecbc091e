"""SparCML's sparse streams: a vector held as sorted (index, value) pairs while that is smaller,
and as a dense array once nnz·(c + isize) ≥ N·isize, i.e. beyond δ = N·isize / (c + isize) (§5.1).
Streams are summed on the way through a reduction and serialised to bytes for the wire; they live
on the gradient's device, their bytes on the wire's."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from sparsecomm.encode.value.dtypes import DTYPE_BY_CODE, FLOAT_DTYPES
from sparsecomm.errors import PayloadError
from sparsecomm.host_memory import write_at

_HEAD = struct.Struct("<BBQQQ")  # dense flag, dtype code, numel (range length), offset, count
_DENSE, _SPARSE = 1, 0


@dataclass
class Stream:
    """A vector of ``length`` entries starting at global position ``offset``; sparse (sorted
    ``indices`` relative to ``offset``) or dense (``indices is None``)."""

    length: int
    values: torch.Tensor
    indices: torch.Tensor | None = None
    offset: int = 0

    @property
    def is_dense(self) -> bool:
        return self.indices is None

    @property
    def nnz(self) -> int:
        return self.length if self.indices is None else self.indices.numel()

    @staticmethod
    def sparse(indices: torch.Tensor, values: torch.Tensor, length: int, offset: int = 0) -> Stream:
        return Stream(length, values, indices, offset).maybe_densify()

    def index_bytes(self) -> int:
        return 4 if self.offset + self.length <= 2**31 else 8

    def switch_point(self) -> float:
        """δ: the nnz at which the dense form becomes no larger than the sparse one."""
        isize = self.values.element_size()
        return self.length * isize / (self.index_bytes() + isize)

    def maybe_densify(self) -> Stream:
        if self.indices is not None and self.nnz >= self.switch_point():
            return Stream(self.length, self.to_dense(), None, self.offset)
        return self

    def to_dense(self) -> torch.Tensor:
        if self.indices is None:
            return self.values
        return write_at(torch.zeros(self.length, dtype=self.values.dtype, device=self.values.device),
                        self.indices, self.values)

    def write_into(self, target: torch.Tensor) -> None:
        """Write this stream's entries into ``target`` (its range, zeroed beforehand, on any device)."""
        if self.indices is None:
            target.copy_(self.values)
        else:
            write_at(target, self.indices, self.values)

    def wire_bytes(self) -> int:
        isize = self.values.element_size()
        return _HEAD.size + (self.length * isize if self.is_dense else self.nnz * (self.index_bytes() + isize))

    def __add__(self, other: Stream) -> Stream:
        return sum_streams([self, other])

    # -- wire ---------------------------------------------------------------------------------
    def to_bytes(self) -> torch.Tensor:
        """The stream's bytes, on the device its entries are on."""
        head = _HEAD.pack(self.is_dense, FLOAT_DTYPES[self.values.dtype], self.length, self.offset, self.nnz)
        parts = [torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self.values.device)]
        if self.indices is not None:
            dtype = torch.int32 if self.index_bytes() == 4 else torch.int64
            parts.append(self.indices.to(dtype).view(torch.uint8))
        parts.append(self.values.detach().contiguous().view(torch.uint8))
        return torch.cat(parts)

    @staticmethod
    def from_bytes(buffer: torch.Tensor, expect: tuple[int, int] | None = None,
                   device: torch.device | None = None) -> Stream:
        """A stream from its bytes (on any device), its entries on ``device`` (default: the bytes');
        ``expect``: the (offset, length) of the range the receiver expects, checked before anything
        the size of the range is allocated."""
        dense, dtype, length, offset, count, index_bytes = _read_head(buffer, expect)
        device = device if device is not None else buffer.device
        body = buffer[_HEAD.size :].to(device)
        values = body[count * index_bytes :].clone().view(dtype) if count else torch.zeros(0, dtype=dtype,
                                                                                            device=device)
        if dense:
            return Stream(length, values, None, offset)
        index_dtype = torch.int32 if index_bytes == 4 else torch.int64
        indices = body[: count * index_bytes].clone().view(index_dtype).to(torch.int64) if count else (
            torch.zeros(0, dtype=torch.int64, device=device))
        if count and (int(indices.min()) < 0 or int(indices.max()) >= length):
            raise PayloadError("stream index outside its range")
        return Stream(length, values, indices, offset)

    @staticmethod
    def write_bytes_into(buffer: torch.Tensor, expect: tuple[int, int], target: torch.Tensor) -> Stream:
        """`from_bytes` then `write_into` ``target``; a dense stream's values go byte for byte into
        ``target`` with no tensor of the range's size in between (its values are then ``target``)."""
        dense, dtype, length, offset, count, _ = _read_head(buffer, expect)
        if dense and count and target.dtype == dtype and target.is_contiguous():
            target.view(torch.uint8).copy_(buffer[_HEAD.size :])
            return Stream(length, target, None, offset)
        stream = Stream.from_bytes(buffer, expect, target.device)
        stream.write_into(target)
        return stream


def sum_streams_into(streams: list[Stream], target: torch.Tensor) -> Stream:
    """The sum of ``streams`` (one range, added in list order) written into ``target``, that range
    of a zeroed buffer: a dense stream over it that needs no buffer of the range's size of its own."""
    first = streams[0]
    if any((s.length, s.offset) != (first.length, first.offset) for s in streams) or target.numel() != first.length:
        raise PayloadError("streams of different ranges cannot be summed")
    for stream in streams:
        _add_into(target, stream)
    return Stream(first.length, target, None, first.offset)


def _add_into(total: torch.Tensor, stream: Stream) -> None:
    """``stream``'s entries added into ``total``, the dense range it covers."""
    if stream.indices is None:
        total += stream.values.to(total.device)
    else:
        total.scatter_add_(0, stream.indices.to(total.device), stream.values.to(total.device))


def _read_head(buffer: torch.Tensor, expect: tuple[int, int] | None) -> tuple[bool, torch.dtype, int, int, int, int]:
    """A stream's (dense, dtype, length, offset, count, index bytes), checked against its size and
    the receiver's ``expect``."""
    if buffer.numel() < _HEAD.size:
        raise PayloadError("stream shorter than its header")
    dense, dtype_code, length, offset, count = _HEAD.unpack(buffer[: _HEAD.size].cpu().numpy().tobytes())
    if dtype_code not in DTYPE_BY_CODE or dense not in (0, 1) or (dense and count != length) or count > length:
        raise PayloadError("stream header is corrupt")
    if expect is not None and (offset, length) != expect:
        raise PayloadError(f"stream covers [{offset}, {offset + length}), the receiver expects "
                           f"[{expect[0]}, {expect[0] + expect[1]})")
    dtype = DTYPE_BY_CODE[dtype_code]
    isize = torch.empty(0, dtype=dtype).element_size()
    index_bytes = 0 if dense else (4 if offset + length <= 2**31 else 8)
    if buffer.numel() != _HEAD.size + count * (index_bytes + isize):
        raise PayloadError(f"stream of {buffer.numel()} bytes does not hold {count} entries")
    return bool(dense), dtype, length, offset, count, index_bytes


DENSE_PATH_FRACTION = 1 / 20
"""Sum by scattering into a dense buffer (one pass over the range) once the operands hold more
than this fraction of it; below, by sorting the operands' indices (cheaper for few entries)."""


def sum_streams(streams: list[Stream]) -> Stream:
    """Element-wise sum of streams over the same range, sparse or dense by the δ rule. With two
    operands the result is bit-identical whichever order they come in (each entry sums at most two
    values), which keeps recursive doubling's partners in agreement."""
    first = streams[0]
    length, offset = first.length, first.offset
    if any((s.length, s.offset) != (length, offset) for s in streams):
        raise PayloadError("streams of different ranges cannot be summed")
    if len(streams) == 1:
        return first
    total_nnz = sum(s.nnz for s in streams)
    dense_inputs = [s for s in streams if s.indices is None]
    if dense_inputs or total_nnz >= DENSE_PATH_FRACTION * length:
        device = first.values.device
        total = dense_inputs[0].values.clone() if dense_inputs else torch.zeros(length, dtype=first.values.dtype,
                                                                                 device=device)
        touched = None if dense_inputs else torch.zeros(length, dtype=torch.bool, device=device)
        for stream in streams:
            if stream is (dense_inputs[0] if dense_inputs else None):
                continue
            _add_into(total, stream)
            if touched is not None and stream.indices is not None:
                touched[stream.indices] = True
        if touched is not None:
            union = torch.nonzero(touched).squeeze(1)
            if union.numel() < Stream(length, total, None, offset).switch_point():
                return Stream(length, total[union], union, offset)
        return Stream(length, total, None, offset)
    indices = torch.cat([s.indices for s in streams if s.indices is not None])
    values = torch.cat([s.values for s in streams])
    unique, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    return Stream.sparse(unique, summed, length, offset)
