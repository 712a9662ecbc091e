"""A device-route call's one host read: a status word of its flags and, where the ``adaptive``
controller asks for them, the largest magnitude the rank sent, the density its gradient's energy
curve prefers and the share of the density it proposes for the next step — built on the device,
read with one ``.item()``.

The word (int64): bits 0–1 the flags (`GOOD`, `OWN_FINITE`); bits 2–33 the preferred density as
float32 bits (0: none); bits 34–49 the magnitude as the upper half of its float32 bits, rounded
up (three significant digits, never below the true value: it guards fp16's range); bits 50–54 the
share in [1, `MAX_SHARE`], in steps of 1/`SHARE_STEPS` above 1, rounded up."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from sparsecomm.device.shares import MAX_SHARE, SHARE_STEPS

GOOD = 1
"""every rank's buffer matched this layout and the sum is finite"""
OWN_FINITE = 2
"""this rank's own gradient was finite"""
FLAG_BITS, DENSITY_BITS, MAGNITUDE_BITS = 2, 32, 16
SHARE_AT = FLAG_BITS + DENSITY_BITS + MAGNITUDE_BITS


@dataclass(frozen=True)
class Status:
    """What one read told: the flags, and what the controller asked for (None where it did not)."""

    flags: int
    magnitude: float | None = None
    density: float | None = None
    share: float | None = None

    @property
    def good(self) -> bool:
        return bool(self.flags & GOOD)

    @property
    def own_finite(self) -> bool:
        return bool(self.flags & OWN_FINITE)


def read(flags: torch.Tensor, magnitude: torch.Tensor | None = None, density: torch.Tensor | None = None,
         share: torch.Tensor | None = None) -> Status:
    """``flags`` (a 0-d integer tensor) and the optional 0-d ``magnitude`` (≥ 0), ``density`` and
    ``share`` in one host read."""
    word = flags if flags.dtype == torch.int64 else flags.to(torch.int64)
    if density is not None:
        word = word | (_float32_bits(density) << FLAG_BITS)
    if magnitude is not None:
        upper = (_float32_bits(magnitude) + 0xFFFF) >> 16  # rounded up to 16 bits
        word = word | (upper << (FLAG_BITS + DENSITY_BITS))
    if share is not None:
        steps = share.to(torch.float32).sub(1.0).mul_(SHARE_STEPS).ceil_().clamp_(0, (MAX_SHARE - 1) * SHARE_STEPS)
        word = word | (steps.to(torch.int64) << SHARE_AT)
    value = int(word.item())
    return Status(value & ((1 << FLAG_BITS) - 1),
                  _float32(((value >> (FLAG_BITS + DENSITY_BITS)) & 0xFFFF) << 16) if magnitude is not None else None,
                  _float32((value >> FLAG_BITS) & 0xFFFFFFFF) if density is not None else None,
                  1.0 + (value >> SHARE_AT) / SHARE_STEPS if share is not None else None)


def _float32_bits(value: torch.Tensor) -> torch.Tensor:
    """A non-negative 0-d tensor's float32 bit pattern, as int64."""
    return value.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _float32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]
