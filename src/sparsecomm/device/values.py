"""The device forms of the value codecs the device route carries: a selection's values into 32-bit
words and back by tensor ops of fixed sizes, on any device.

``fp32``, ``fp16`` and ``bf16`` are casts; ``int8`` is blockwise absmax quantization as the host
codec's (a scale per ``bucket`` values, levels in [-127, 127]), computed by division so that no
scale overflows. What `encode` returns is what every receiver decodes, bit for bit, so the
feedback keeps exactly what was lost. A non-finite value makes its block's decode non-finite
(never an undefined cast), so the sum's check sees it.
"""

from __future__ import annotations

import torch

from sparsecomm.encode.base import ValueCodec
from sparsecomm.encode.value.floats import FloatValues
from sparsecomm.encode.value.int8 import LEVELS, Int8Values


def supported(codec: ValueCodec) -> bool:
    """Whether ``codec`` has a device form."""
    return isinstance(codec, FloatValues | Int8Values)


def lossless(codec: ValueCodec) -> bool:
    """Whether fp32 values arrive exactly."""
    return isinstance(codec, FloatValues) and codec.wire_dtype == torch.float32


def nwords(codec: ValueCodec, count: int) -> int:
    """32-bit words that ``count`` values take."""
    if isinstance(codec, Int8Values):
        return -(-count // codec.bucket) + -(-count // 4)
    assert isinstance(codec, FloatValues)
    return -(-count * codec.itemsize // 4)


def encode(codec: ValueCodec, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``values`` (fp32) into ``out`` (int32, `nwords` long); returns what receivers decode."""
    count = values.numel()
    if isinstance(codec, Int8Values):
        blocks = -(-count // codec.bucket)
        padded = values.new_zeros(blocks * codec.bucket)
        padded[:count] = values
        grid = padded.view(blocks, codec.bucket)
        scales = grid.abs().amax(dim=1) if blocks else padded.new_zeros(0)
        levels = grid.mul(LEVELS).div_(scales[:, None]).round_()  # a block of zeros: 0/0, NaN, then level 0
        levels = torch.nan_to_num_(levels, nan=0.0).clamp_(-LEVELS, LEVELS).to(torch.int8)
        out[:blocks].copy_(scales.view(torch.int32))
        stored = torch.zeros(4 * (out.numel() - blocks), dtype=torch.int8, device=values.device)
        stored[:count] = levels.view(-1)[:count]
        out[blocks:].copy_(stored.view(torch.int32))
        return _scaled(levels, scales).view(-1)[:count]
    assert isinstance(codec, FloatValues)
    cast = torch.zeros(out.numel() * 4 // codec.itemsize, dtype=codec.wire_dtype, device=values.device)
    cast[:count] = values
    out.copy_(cast.view(torch.int32))
    return cast[:count].float()


def decode(codec: ValueCodec, words: torch.Tensor, count: int) -> torch.Tensor:
    """Each row of ``words`` (int32, ranks × `nwords`) back to ``count`` fp32 values."""
    words = words.contiguous()
    if isinstance(codec, Int8Values):
        blocks = -(-count // codec.bucket)
        scales = words[:, :blocks].contiguous().view(torch.float32)
        stored = words[:, blocks:].contiguous().view(torch.int8)[:, :count]
        levels = stored.new_zeros(words.shape[0], blocks * codec.bucket)
        levels[:, :count] = stored
        rows = words.shape[0]
        return _scaled(levels.view(rows, blocks, codec.bucket), scales).view(rows, -1)[:, :count]
    assert isinstance(codec, FloatValues)
    return words.view(codec.wire_dtype)[:, :count].float()


def _scaled(levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Levels (… × blocks × bucket) times their block's scale / 127, in fp32: the sender's and the
    receivers' one arithmetic, so both get the same bits. The divisor is a tensor on the levels'
    device: CUDA divides by a number as a product with its reciprocal, a bit off a processor's
    quotient at times, and every device must reach the same bits."""
    return levels.float().div_(scales.new_full((), LEVELS)).mul_(scales[..., None])
