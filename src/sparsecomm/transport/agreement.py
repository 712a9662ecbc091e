"""The agreement step: the first collective of every transport call.

One fixed-size all_gather of every rank's (tensor size, configuration fingerprint, stream key, call
number, nnz, a flag — non-finite input, or values its codec refused —, payload size). Every rank
checks the same table, so either all of them go on — knowing the largest nnz, their sum and, when
all sent one, every payload size — or all raise `SparseCommError`, none left hanging in a later
collective. Because the stream's key and call number are in it, ranks that pass tensors in
different orders or counts fail with the key named instead of summing the wrong tensors together. Each record also
carries the request's side numbers (`sparsecomm.transport.side_numbers`), which every rank gets
back from every rank, unchecked.
"""

from __future__ import annotations

import torch

from sparsecomm.errors import NonFiniteError, SparseCommError
from sparsecomm.transport.collectives import Group, all_gather_single, on_wire, wire_device, world
from sparsecomm.transport.request import Agreement, Request
from sparsecomm.transport.side_numbers import SIDE_FIELDS, side_words, sides_of_table
from sparsecomm.transport.waiting import wait_for

_NUMEL, _CONFIG, _KEY, _CALL, _NNZ, _FLAG, _NBYTES = range(7)
NONFINITE, REFUSED = 1, 2
"""the flag's values: this rank's input was non-finite; it could not make its part of the call (its
codec refused its values, or another error)"""
NBYTES_FIELD = _NBYTES
"""where the payload size sits in a record"""
CHECKED_FIELDS = 7
RECORD_FIELDS = CHECKED_FIELDS + SIDE_FIELDS
SHOWN_KEY_CHARS = 160


def agree(group: Group, request: Request, numel: int, config: int, nnz: int = 0, nbytes: int = 0) -> Agreement:
    """Run the agreement step for one call (``nbytes`` > 0: carry this rank's payload size too),
    unless the request already carries its outcome (a caller such as ``auto`` ran it)."""
    if request.agreement is not None:
        return request.agreement
    _, size = world(group)
    device = wire_device(group)
    record = on_wire(agreement_record(request, numel, config, nnz, nbytes), device)
    table = torch.zeros(size, record.numel(), dtype=torch.int64, device=device)
    wait_for(all_gather_single(table.view(-1), record, group=group, async_op=True), device)
    return check_table(table.cpu(), request, numel, config)


def agreement_record(request: Request, numel: int, config: int, nnz: int = 0, nbytes: int = 0) -> torch.Tensor:
    """This rank's row of the agreement table (`RECORD_FIELDS` int64 values: the checked fields, then
    the request's side numbers)."""
    flag = NONFINITE if request.nonfinite else REFUSED if request.refused else 0
    checked = [numel, config, request.key_hash, request.call, nnz, flag, nbytes]
    return torch.tensor(checked + side_words(request.side), dtype=torch.int64)


def check_table(table: torch.Tensor, request: Request, numel: int, config: int) -> Agreement:
    """Check every rank's row (a ``world size × RECORD_FIELDS`` table, the same on every rank) against
    this rank's call: raise `SparseCommError` on any disagreement, else the `Agreement`. The checks
    read the table as Python integers: a few rows, where each torch operation would cost more than
    the comparison it makes."""
    rows = table.tolist()
    key = request.key if len(request.key) <= SHOWN_KEY_CHARS else request.key[:SHOWN_KEY_CHARS] + "…"
    if any(row[_KEY] != request.key_hash or row[_CALL] != request.call for row in rows):
        raise SparseCommError(
            f"ranks passed different tensors to the same collective: this rank passed {key!r} (call "
            f"{request.call}), others a different key or call number — every rank must reduce the same "
            "named tensors in the same order")
    if any(row[_FLAG] == REFUSED for row in rows):  # a refusal's record may hold no size or configuration
        raise SparseCommError(f"a rank could not make its part of {key!r} (that rank's error says why); no rank "
                              "applied it"
                              + (f" — this one: {request.refused}" if request.refused else ""))
    if any(row[_NUMEL] != numel or row[_CONFIG] != config for row in rows):
        numels = [row[_NUMEL] for row in rows]
        raise SparseCommError(
            f"ranks disagree on tensor size or transport configuration for {key!r} (this rank: numel "
            f"{numel}, config {config:#x}; across ranks numel {min(numels)}..{max(numels)})")
    if any(row[_FLAG] for row in rows):
        raise NonFiniteError(f"a rank had a non-finite gradient (NaN or Inf) in {key!r}; no rank applied it"
                              + (" — including this one" if request.nonfinite else ""))
    sizes = tuple(row[_NBYTES] for row in rows)
    nnzs = [row[_NNZ] for row in rows]
    return Agreement(max(nnzs), sizes if min(sizes) > 0 else None, sides_of_table(table[:, CHECKED_FIELDS:]),
                     total_nnz=sum(nnzs))
