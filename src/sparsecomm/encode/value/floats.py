"""``fp32``, ``fp16``, ``bf16``: values cast to a float format and sent as its raw bytes.

fp16 overflows to ±inf above 65504; a value that would is rejected rather than sent as inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from sparsecomm.encode.base import VALUE_CODECS, ValueCodec
from sparsecomm.encode.value.dtypes import cast_within, tensor_bytes, tensor_from_bytes
from sparsecomm.errors import SparseCommError
from sparsecomm.finite import all_finite


class FloatValues(ValueCodec):
    wire_dtype: ClassVar[torch.dtype] = torch.float32

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.wire_dtype).element_size()

    def encode(self, values: torch.Tensor, rng: np.random.Generator) -> bytes:
        cast = values.to(self.wire_dtype)
        # finite values stay finite in a format that holds them all; a narrower one may overflow
        if not self.lossless_for(values.dtype) and not all_finite(cast):
            raise SparseCommError(f"a value overflows {self.name}; use a wider value codec")
        return tensor_bytes(cast).tobytes()

    def decode(self, data: memoryview, nnz: int, dtype: torch.dtype) -> torch.Tensor:
        return tensor_from_bytes(data, self.wire_dtype, nnz).to(dtype)

    def max_count(self, nbytes: int) -> int:
        return nbytes // self.itemsize

    def largest(self) -> float:
        return torch.finfo(self.wire_dtype).max

    def lossless_for(self, dtype: torch.dtype) -> bool:
        return torch.promote_types(dtype, self.wire_dtype) == self.wire_dtype  # the wire holds every value

    def as_decoded(self, values: torch.Tensor) -> torch.Tensor:
        """The cast there and back, which is what `decode` returns."""
        return values if self.lossless_for(values.dtype) else cast_within(values.to(self.wire_dtype), values.dtype)


@VALUE_CODECS.register("fp32")
@dataclass(frozen=True)
class Float32Values(FloatValues):
    wire_dtype = torch.float32


@VALUE_CODECS.register("fp16")
@dataclass(frozen=True)
class Float16Values(FloatValues):
    wire_dtype = torch.float16
    lossless = False


@VALUE_CODECS.register("bf16")
@dataclass(frozen=True)
class BFloat16Values(FloatValues):
    wire_dtype = torch.bfloat16
    lossless = False
