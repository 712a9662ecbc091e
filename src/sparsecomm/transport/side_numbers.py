"""Side numbers: a few float64 values each rank shares with every rank on a collective it runs anyway,
so that sharing them costs no collective of its own (the adaptive budget's per-step reports ride
this way).

Two carriers, each exact:

- a transport call's agreement record, which every rank already sends to every rank: `SIDE_FIELDS`
  more int64 words holding the values' bits (`side_words`, `sides_of_table`);
- a dense all_reduce: `tail_elements` more elements at the end of the summed tensor, one byte of
  the values per element, each rank's bytes in slots of its own and zeros in every other rank's
  (`write_tail`, `read_tail`). A sum of one integer below 256 and zeros is that integer in fp32,
  fp16 and bf16 alike, so every rank reads back every rank's bytes exactly, whatever the wire's
  dtype and however the backend orders its additions.
"""

from __future__ import annotations

import struct

import torch

from sparsecomm.errors import SparseCommError

SIDE_FIELDS = 14
"""values per rank a call can carry"""
_SIDE_BYTES = SIDE_FIELDS * 8


def side_words(side: tuple[float, ...]) -> list[int]:
    """``side`` (at most `SIDE_FIELDS` values, zero-padded) as int64 words of their float64 bits."""
    if len(side) > SIDE_FIELDS:
        raise SparseCommError(f"a call carries at most {SIDE_FIELDS} side numbers, not {len(side)}")
    padded = (*side, *[0.0] * (SIDE_FIELDS - len(side)))
    return list(struct.unpack(f"={SIDE_FIELDS}q", struct.pack(f"={SIDE_FIELDS}d", *padded)))


def sides_of_table(words: torch.Tensor) -> torch.Tensor:
    """Every rank's side numbers (world size × `SIDE_FIELDS` float64) from its rows of side words."""
    return words.contiguous().view(torch.float64).reshape(-1, SIDE_FIELDS)


def tail_elements(world_size: int) -> int:
    """Elements a dense all_reduce needs at its end to carry every rank's side numbers."""
    return world_size * _SIDE_BYTES


def write_tail(tail: torch.Tensor, side: tuple[float, ...], rank: int) -> None:
    """This rank's side numbers into its slots of ``tail`` (`tail_elements` long), zeros elsewhere."""
    tail.zero_()
    own = torch.tensor(side_words(side), dtype=torch.int64).view(torch.uint8)
    tail[rank * _SIDE_BYTES:(rank + 1) * _SIDE_BYTES].copy_(own.to(tail.device, tail.dtype))


def read_tail(tail: torch.Tensor) -> torch.Tensor:
    """Every rank's side numbers (world size × `SIDE_FIELDS` float64) from a summed tail."""
    as_bytes = tail.detach().to("cpu", torch.float32).round_().to(torch.uint8)
    return as_bytes.view(torch.float64).reshape(-1, SIDE_FIELDS)
