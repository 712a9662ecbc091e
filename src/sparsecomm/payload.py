"""The self-describing payload: one sparse gradient, encoded, in bytes that need nothing else to decode.

Wire format, version 2 (all integers little-endian; a payload of any other version is refused)::

    offset  size  field
    0       4     magic b"SPCM"
    4       1     format version (2)
    5       1     flags: bit 0 lossy indices, bit 1 lossy values, bit 2 runs block
    6       1     dtype code (1 float32, 2 float16, 3 bfloat16, 4 float64)
    7       1     ndim (0..8)
    8       8     numel
    16      8     nnz
    24      1     length of the index codec's spec text (1..255)
    25      1     length of the value codec's spec text (1..255)
    26      8     index section length
    34      8     value section length
    42      8*ndim  shape
    ...           index codec spec text (ASCII, e.g. "rice"), value codec spec text (e.g. "qsgd(bits=4)")
    ...           index section, value section
    end-4   4     CRC32 of everything before it

With flag bit 2, the index section opens with a runs block: long runs of consecutive indices as
(start, length) pairs, and the index codec codes only the other indices, as positions among the
tensor's positions outside the runs (`sparsecomm.encode.runs`). The encoder writes one where the
selection holds a run of `MIN_RUN` or more indices and it makes the section shorter, for a lossless
index codec that does not code the values. The values follow every index in ascending order either
way.

Bounds on decode (tested in ``tests/test_decode_bounds.py``, fuzzed by ``sparsecomm fuzz``): the CRC
and every length are checked before any section is read; numel ≤ 2**48; nnz ≤ numel and nnz ≤
each codec's ``max_count`` for its section's size (the index codec's: the indices outside a runs
block, for what follows the block); every codec parameter named in the payload is range-checked
when the codec is built from its text. A receiver that knows the tensor it expects passes
``expect=`` (every transport does) and a payload for another size is refused before any section is
read. A runs block is checked whole (in order, inside the tensor, no more indices than nnz) first,
and its runs are expanded only once both sections have decoded. Then decoding a payload of B bytes
for a tensor of N elements allocates at most
``DECODE_BYTES_PER_BYTE``·B + ``DECODE_BYTES_PER_VALUE``·min(nnz, N) + ``DECODE_OVERHEAD`` bytes
and takes time linear in B + nnz, except a Bloom filter's, which tests all N indices (O(N) time,
O(chunk) memory). Without ``expect=`` a Bloom payload may claim at most ``SCAN_WITHOUT_EXPECT``
elements.

A joint codec (``skcompress``) codes indices and values in the index section; the value section
is then empty and names ``fp32``.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from sparsecomm.encode.base import INDEX_CODECS, VALUE_CODECS, IndexCodec, ValueCodec
from sparsecomm.encode.runs import Runs, with_runs
from sparsecomm.encode.value.dtypes import DTYPE_BY_CODE, FLOAT_DTYPES, cast_within
from sparsecomm.errors import PayloadError, SparseCommError, SpecError
from sparsecomm.finite import all_finite
from sparsecomm.registry import Component, Registry
from sparsecomm.sparse_gradient import SparseGradient

MAGIC = b"SPCM"
FORMAT_VERSION = 2
MAX_NDIM = 8
MAX_NUMEL = 1 << 48
FLAG_LOSSY_INDICES = 1
FLAG_LOSSY_VALUES = 2
FLAG_RUNS = 4
_HEADER = struct.Struct("<4sBBBBQQBBQQ")
_CRC = struct.Struct("<I")
MIN_PAYLOAD = _HEADER.size + 2 + _CRC.size
DECODE_BYTES_PER_BYTE = 4096
DECODE_BYTES_PER_VALUE = 256
DECODE_OVERHEAD = 16 << 20
"""the documented bound on decode's allocations (see the module docstring)"""
SCAN_WITHOUT_EXPECT = 1 << 24
"""the most elements a codec that tests every index may scan when the receiver passes no ``expect``"""
JOINT_VALUE_SPEC = "fp32"
"""the value codec a payload names when its index codec codes the values too (its section is empty)"""

CodecT = TypeVar("CodecT", IndexCodec, ValueCodec)
PayloadLike = bytes | bytearray | memoryview | torch.Tensor


@dataclass(frozen=True)
class PayloadInfo:
    """What a payload's header says, without decoding the sections."""

    version: int
    flags: int
    dtype: torch.dtype
    shape: torch.Size
    numel: int
    nnz: int
    index_codec: str
    value_codec: str
    index_bytes: int
    value_bytes: int
    total_bytes: int

    @property
    def lossless(self) -> bool:
        return self.flags & (FLAG_LOSSY_INDICES | FLAG_LOSSY_VALUES) == 0


def encode(
    grad: SparseGradient,
    index_codec: IndexCodec | str = "raw",
    value_codec: ValueCodec | str = "fp32",
    rng: np.random.Generator | None = None,
    dense: torch.Tensor | None = None,
) -> bytes:
    """Encode a sparse gradient into a payload: bytes that need nothing else to decode.

    Indices are sorted (values follow). The payload names its codecs, so `decode` needs nothing but
    the bytes (layout: this module's docstring).

    Args:
        grad: the entries to send (unique indices, finite float values).
        index_codec: an index codec, or its spec text (``"rice"``, ``"bloom(policy=p0)"``); a joint
            codec (``"skcompress"``) codes the values too, and then ``value_codec`` must stay
            ``"fp32"``.
        value_codec: a value codec, or its spec text (``"fp16"``, ``"qsgd(bits=4)"``).
        rng: feeds stochastic codecs (QSGD, Bloom policies); by default a generator seeded with 0,
            so equal inputs give equal bytes.
        dense: the gradient the selection came from: gives the values of any index a lossy index
            codec sends beyond the selection (zero without it).

    Returns:
        The payload.

    Raises:
        SparseCommError: duplicate or out-of-range indices, non-finite values, a dtype that is not
            a float, a codec of the wrong kind, or values the codec cannot carry (beyond fp16's
            range).
        SpecError: a codec's spec text is invalid.

    Example:
        ```python
        import torch

        import sparsecomm as sc

        grad = sc.SparseGradient(torch.tensor([7, 2, 40]), torch.tensor([0.5, -1.0, 2.0]), torch.Size([64]))
        payload = sc.encode(grad, "rice", "fp16")
        print(len(payload), sc.read_info(payload).value_codec)
        ```
    """
    index = _as_codec(INDEX_CODECS, index_codec, IndexCodec)
    value = _as_codec(VALUE_CODECS, value_codec, ValueCodec)
    if grad.dtype not in FLOAT_DTYPES:
        raise SparseCommError(f"values must be a float type ({', '.join(map(str, FLOAT_DTYPES))}), got {grad.dtype}")
    if len(grad.shape) > MAX_NDIM or grad.numel > MAX_NUMEL:
        raise SparseCommError(f"tensors up to {MAX_NDIM} dims and {MAX_NUMEL} elements are supported")
    indices, values = _sorted_unique(grad)
    if not all_finite(values):
        bad = int(torch.nonzero(~torch.isfinite(values))[0])
        raise SparseCommError(f"non-finite value {values[bad].item()} at index {int(indices[bad])}")
    rng = rng if rng is not None else np.random.default_rng(0)
    has_runs = False
    if index.codes_values:
        if value.to_spec() != JOINT_VALUE_SPEC:
            raise SparseCommError(f"{index.name} codes the values itself; leave the value codec out")
        index_section, sent, value_section = index.encode_joint(indices, values, grad.numel, rng), indices, b""
    else:
        index_section, sent = index.encode_selecting(indices, grad.numel, rng)
        if sent is not indices:
            values = _values_at(sent, indices, values, dense)
        elif index.lossless:
            listed = with_runs(index, indices, grad.numel, index_section)
            index_section, has_runs = (index_section, False) if listed is None else (listed, True)
        value_section = value.encode(values, rng)
    index_spec = index.to_spec().encode("ascii")
    value_spec = value.to_spec().encode("ascii")
    values_exact = index.values_lossless if index.codes_values else value.lossless_for(grad.dtype)
    flags = ((0 if index.lossless else FLAG_LOSSY_INDICES) | (0 if values_exact else FLAG_LOSSY_VALUES)
             | (FLAG_RUNS if has_runs else 0))
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, flags, FLOAT_DTYPES[grad.dtype], len(grad.shape), grad.numel, sent.size,
        len(index_spec), len(value_spec), len(index_section), len(value_section),
    )
    body = b"".join(
        [header, struct.pack(f"<{len(grad.shape)}Q", *grad.shape), index_spec, value_spec,
         index_section, value_section]
    )
    return body + _CRC.pack(zlib.crc32(body))


def decode(payload: PayloadLike, device: torch.device | str | None = None,
           expect: int | Sequence[int] | None = None) -> SparseGradient:
    """Decode a payload into a `SparseGradient` (indices ascending).

    Decoding is bounded: the checksum and every length are checked before any section is read, and
    its time and memory grow with the payload's size and nnz (see this module's docstring).

    Args:
        payload: the bytes (or a 1-D uint8 tensor) `encode` made.
        device: where the decoded indices and values go (default: the CPU).
        expect: the tensor the receiver expects, as a shape or an element count; a payload for any
            other is refused before its sections are read.

    Returns:
        The entries the payload carries, as the receiver sees them (after a lossy codec, the
        decoded values).

    Raises:
        PayloadError: anything wrong with the bytes — truncated, corrupted, of another format
            version, for another tensor than ``expect``, or internally inconsistent — saying what.

    Example:
        ```python
        import torch

        import sparsecomm as sc

        grad = torch.zeros(1000)
        grad[[3, 500]] = torch.tensor([1.0, -2.0])
        received = sc.decode(sc.encode(sc.SparseGradient.from_dense(grad), "rice"), expect=(1000,))
        assert torch.equal(received.to_dense(), grad)
        ```
    """
    data = as_bytes(payload)
    info, offsets = _read_header(data)
    _check_expected(info, expect)
    index_codec = _codec_from_wire(INDEX_CODECS, info.index_codec, IndexCodec)
    value_codec = _codec_from_wire(VALUE_CODECS, info.value_codec, ValueCodec)
    if index_codec.scans_numel and expect is None and info.numel > SCAN_WITHOUT_EXPECT:
        raise PayloadError(f"{info.index_codec} tests every one of the {info.numel} indices the payload claims; "
                           f"pass expect= to decode more than {SCAN_WITHOUT_EXPECT} without it")
    if not index_codec.codes_values and info.nnz > value_codec.max_count(info.value_bytes):
        raise PayloadError(f"nnz {info.nnz} cannot fit in {info.value_bytes} bytes of {info.value_codec}")
    view = memoryview(data)
    index_start, value_start = offsets
    if index_codec.codes_values and (info.value_bytes or info.value_codec != JOINT_VALUE_SPEC):
        raise PayloadError(f"{info.index_codec} codes the values itself, yet the payload has a value section")
    listed, stream = _runs_block(info, index_codec, view[index_start:value_start])
    coded, coded_numel = (info.nnz, info.numel) if listed is None else (info.nnz - listed.total,
                                                                         info.numel - listed.total)
    if coded > index_codec.max_count(len(stream), coded_numel):
        raise PayloadError(f"nnz {coded} cannot fit in {len(stream)} bytes of {info.index_codec}")
    exact = index_codec.values_lossless if index_codec.codes_values else value_codec.lossless_for(info.dtype)
    rebuilt = info.dtype if exact else torch.promote_types(info.dtype, torch.float32)  # then cast within range
    try:
        if index_codec.codes_values:
            indices, values = index_codec.decode_joint(stream, info.numel, info.nnz, rebuilt)
        else:
            indices = index_codec.decode(stream, coded_numel, coded)
            values = value_codec.decode(view[value_start : value_start + info.value_bytes], info.nnz, rebuilt)
            if listed is not None:  # expanded only once every section has decoded
                _check_indices(indices, coded, coded_numel)
                indices = listed.merged(indices)
    except PayloadError:
        raise
    except (ValueError, IndexError, OverflowError, TypeError, MemoryError) as err:
        raise PayloadError(f"{info.index_codec}/{info.value_codec} section is malformed: {err}") from None
    _check_indices(indices, info.nnz, info.numel)
    values = cast_within(values, info.dtype)
    if values.shape != (info.nnz,) or not all_finite(values):  # a sender never sends them
        raise PayloadError(f"value section decoded to {tuple(values.shape)} values, not {info.nnz} finite ones")
    grad = SparseGradient(torch.from_numpy(np.ascontiguousarray(indices)), values, info.shape)
    return grad.to(device) if device is not None else grad


def read_info(payload: PayloadLike) -> PayloadInfo:
    """The header of a payload, without decoding its sections.

    Args:
        payload: the bytes (or a 1-D uint8 tensor) `encode` made.

    Returns:
        A `PayloadInfo`: format version, flags, dtype, shape, nnz, the codecs' spec texts and the
        section sizes.

    Raises:
        PayloadError: the CRC or a length does not check out, or the header is not a sparsecomm
            payload's.

    Example:
        ```python
        import torch

        import sparsecomm as sc

        selection = sc.SPARSIFIERS.parse("topk(k=10)").sparsify(torch.randn(1000))
        info = sc.read_info(sc.encode(selection, "rice", "qsgd(bits=4)"))
        print(info.nnz, info.shape, info.index_codec, info.value_codec, info.lossless)
        ```
    """
    return _read_header(as_bytes(payload))[0]


def as_bytes(payload: PayloadLike) -> bytes:
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise PayloadError("a payload tensor must be 1-D uint8")
        return payload.cpu().numpy().tobytes()
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    raise PayloadError(f"a payload is bytes or a uint8 tensor, got {type(payload).__name__}")


def as_tensor(payload: bytes) -> torch.Tensor:
    """A payload as a 1-D uint8 tensor, for collectives."""
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


# -- internals ----------------------------------------------------------------------------------
def _as_codec(registry: Registry, codec: Component | str, kind: type[CodecT]) -> CodecT:
    component = registry.parse(codec) if isinstance(codec, str) else codec
    if not isinstance(component, kind):
        raise SparseCommError(f"{component.name!r} is a {component.kind}, not a {registry.kind} codec")
    return component


def _codec_from_wire(registry: Registry, text: str, kind: type[CodecT]) -> CodecT:
    try:
        return _as_codec(registry, text, kind)
    except SpecError as err:
        raise PayloadError(f"payload names an unusable {registry.kind} codec: {err}") from None


def _sorted_unique(grad: SparseGradient) -> tuple[np.ndarray, torch.Tensor]:
    grad = grad.to_host().sorted()  # checked for order on the host: no extra device pass and sync
    indices = grad.indices.detach().numpy().astype(np.int64, copy=False)
    values = grad.values.detach()
    if indices.size:
        repeated = indices[1:] == indices[:-1]
        if repeated.any():
            dup = int(indices[1:][repeated][0])
            raise SparseCommError(f"duplicate index {dup}: a sparse gradient holds each index once")
        if indices[0] < 0 or indices[-1] >= grad.numel:
            raise SparseCommError(f"index out of range [0, {grad.numel})")
    return indices, values


def _values_at(wanted: np.ndarray, indices: np.ndarray, values: torch.Tensor,
               dense: torch.Tensor | None) -> torch.Tensor:
    """Values at ``wanted``: the selection's where it has them, else ``dense``'s (else zero)."""
    position = np.minimum(np.searchsorted(indices, wanted), max(indices.size - 1, 0))
    selected = (indices[position] == wanted) if indices.size else np.zeros(wanted.size, dtype=bool)
    if dense is not None:
        out = dense.detach().reshape(-1)[torch.from_numpy(wanted).to(dense.device)].to("cpu", values.dtype)
        if not all_finite(out):
            raise SparseCommError("the dense gradient has non-finite values where the index codec sends them")
    else:
        out = torch.zeros(wanted.size, dtype=values.dtype)
    out[torch.from_numpy(selected)] = values[torch.from_numpy(position[selected])]
    return out


def _read_header(data: bytes) -> tuple[PayloadInfo, tuple[int, int]]:
    if len(data) < MIN_PAYLOAD:
        raise PayloadError(f"payload of {len(data)} bytes is shorter than the {MIN_PAYLOAD}-byte minimum")
    (magic, version, flags, dtype_code, ndim, numel, nnz, index_spec_len, value_spec_len,
     index_bytes, value_bytes) = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PayloadError(f"not a sparsecomm payload (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise PayloadError(f"payload format version {version}; this sparsecomm reads version {FORMAT_VERSION}")
    if ndim > MAX_NDIM:
        raise PayloadError(f"payload claims {ndim} dimensions (max {MAX_NDIM})")
    expected = _HEADER.size + 8 * ndim + index_spec_len + value_spec_len + index_bytes + value_bytes + _CRC.size
    if expected != len(data):
        raise PayloadError(f"payload is {len(data)} bytes but its header describes {expected} (truncated?)")
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(memoryview(data)[: -_CRC.size]) != crc:
        raise PayloadError("payload checksum mismatch (corrupted in transit?)")
    if dtype_code not in DTYPE_BY_CODE:
        raise PayloadError(f"unknown dtype code {dtype_code}")
    if flags & ~(FLAG_LOSSY_INDICES | FLAG_LOSSY_VALUES | FLAG_RUNS):
        raise PayloadError(f"unknown flags {flags:#x}")
    offset = _HEADER.size
    shape = torch.Size(struct.unpack_from(f"<{ndim}Q", data, offset))
    offset += 8 * ndim
    if numel > MAX_NUMEL or max(shape, default=0) > MAX_NUMEL or math.prod(shape) != numel:
        raise PayloadError(f"shape {tuple(shape)} does not match numel {numel} (max {MAX_NUMEL})")
    if nnz > numel:
        raise PayloadError(f"nnz {nnz} exceeds numel {numel}")
    try:
        index_spec = data[offset : offset + index_spec_len].decode("ascii")
        value_spec = data[offset + index_spec_len : offset + index_spec_len + value_spec_len].decode("ascii")
    except UnicodeDecodeError:
        raise PayloadError("codec names are not ASCII") from None
    offset += index_spec_len + value_spec_len
    info = PayloadInfo(
        version, flags, DTYPE_BY_CODE[dtype_code], shape, numel, nnz, index_spec, value_spec,
        index_bytes, value_bytes, len(data),
    )
    return info, (offset, offset + index_bytes)


def _runs_block(info: PayloadInfo, codec: IndexCodec, section: memoryview) -> tuple[Runs | None, memoryview]:
    """(the runs a runs block lists, the index codec's stream): None and the whole section without
    the flag."""
    if not info.flags & FLAG_RUNS:
        return None, section
    if codec.codes_values or not codec.lossless or info.flags & FLAG_LOSSY_INDICES:
        raise PayloadError(f"a runs block with {info.index_codec}, which codes lossy indices or the values too")
    return Runs.read(section, info.numel, info.nnz)


def _check_expected(info: PayloadInfo, expect: int | Sequence[int] | None) -> None:
    if expect is None:
        return
    if isinstance(expect, int):
        if info.numel != expect:
            raise PayloadError(f"payload holds a tensor of {info.numel} elements, the receiver expects {expect}")
    elif tuple(info.shape) != tuple(expect):
        raise PayloadError(f"payload holds a tensor of shape {tuple(info.shape)}, the receiver expects "
                           f"{tuple(expect)}")


def _check_indices(indices: np.ndarray, nnz: int, numel: int) -> None:
    if indices.shape != (nnz,):
        raise PayloadError(f"index section decoded to {indices.size} indices, header says {nnz}")
    # compared, not subtracted: a difference of int64 indices can overflow and pass as positive
    if nnz and (indices[0] < 0 or indices[-1] >= numel or not (indices[1:] > indices[:-1]).all()):
        raise PayloadError("decoded indices are not strictly increasing inside the tensor")
