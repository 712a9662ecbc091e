"""What a ``topk_sa`` owner tells every rank of its range besides its kept sums: how many sums it
had before its cut, in `OWNER_BINS` equal parts of the range. Its kept sums are ⌈k/P⌉ whatever the
range holds, so only these counts show where the selections lie; every rank splits the next call's
ranges by them alike (`sparsecomm.transport.sparse_allreduce.balanced_bounds`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsecomm.errors import PayloadError
from sparsecomm.transport.streams import Stream

OWNER_BINS = 16
"""the parts of its range a ``topk_sa`` owner counts its sums in before its cut (int32 each: a fixed
64 bytes an owner, so a rank receives 64(P − 1) bytes of counts a call)"""


OWNER_COUNTS_BYTES = 4 * OWNER_BINS
"""the bytes of counts an owner sends each other rank"""


def owner_counts_bytes(workers: int) -> int:
    """The bytes of counts a ``topk_sa`` owner sends on with its sums, to the ``workers`` − 1 others."""
    return OWNER_COUNTS_BYTES * max(0, workers - 1)


def owner_counts(stream: Stream) -> torch.Tensor:
    """How many of ``stream``'s nonzero entries fall in each of `OWNER_BINS` equal parts of its
    range (entry x of a range of L in part ⌊x·OWNER_BINS/L⌋), as int32."""
    if stream.length == 0:
        return torch.zeros(OWNER_BINS, dtype=torch.int32, device=stream.values.device)
    if stream.indices is not None:
        where = stream.indices
    else:
        where = torch.arange(stream.length, device=stream.values.device)[stream.values != 0]
    return torch.bincount(where * OWNER_BINS // stream.length, minlength=OWNER_BINS).to(torch.int32)


def owner_edges(bounds: Sequence[int]) -> torch.Tensor:
    """The positions where the `OWNER_BINS` parts of each range of ``bounds`` begin, and the end:
    ⌈s·L/OWNER_BINS⌉ into a range of L, so part s holds exactly the entries `owner_counts` puts there."""
    at = torch.tensor(bounds, dtype=torch.int64)
    starts, widths = at[:-1, None], (at[1:] - at[:-1])[:, None]
    parts = torch.arange(OWNER_BINS, dtype=torch.int64)
    return torch.cat([(starts + (parts * widths + OWNER_BINS - 1) // OWNER_BINS).reshape(-1), at[-1:]])


def without_counts(buffer: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``buffer`` less the `owner_counts` appended to it, which are written into ``counts``."""
    size = OWNER_COUNTS_BYTES
    if buffer.numel() < size:
        raise PayloadError(f"an owner's message of {buffer.numel()} bytes cannot end in {size} bytes of counts")
    cut = buffer.numel() - size
    counts.copy_(buffer[cut:].clone().view(torch.int32).to(counts.device, torch.int64))
    return buffer[:cut]
