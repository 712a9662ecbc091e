"""``zstd``: the values' bytes (byte-shuffled as in ``deflate``) through Zstandard. Lossless."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from sparsecomm.encode.base import VALUE_CODECS, ValueCodec
from sparsecomm.encode.value.deflate import shuffle_bytes, unshuffle_bytes
from sparsecomm.encode.value.dtypes import tensor_bytes, tensor_from_bytes
from sparsecomm.errors import PayloadError, SparseCommError

MAX_EXPANSION = 1 << 16  # bound on the declared content size per input byte that we accept


@VALUE_CODECS.register("zstd")
@dataclass(frozen=True)
class ZstdValues(ValueCodec):
    level: int = 3
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.level <= 22:
            raise SparseCommError("zstd level must be in 1..22")

    def encode(self, values: torch.Tensor, rng: np.random.Generator) -> bytes:
        compressor = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return compressor.compress(shuffle_bytes(tensor_bytes(values), self.shuffle))

    def decode(self, data: memoryview, nnz: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        expected = nnz * itemsize
        frame = bytes(data)
        try:
            declared = zstandard.frame_content_size(frame)
            if declared != expected:
                raise PayloadError(f"zstd frame declares {declared} bytes, expected {expected}")
            raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=expected, allow_extra_data=False)
        except zstandard.ZstdError as err:
            raise PayloadError(f"zstd stream is corrupt: {err}") from None
        if len(raw) != expected:
            raise PayloadError(f"zstd stream does not hold exactly {nnz} values")
        return tensor_from_bytes(unshuffle_bytes(raw, nnz, itemsize, self.shuffle), dtype, nnz)

    def max_count(self, nbytes: int) -> int:
        return MAX_EXPANSION * nbytes
