"""``rows``: a sparse COO gradient (``nn.Embedding(sparse=True)``) sent whole — all its rows, no
sparsifier — through the pipeline's transport, or ``allgather`` where that is ``dense`` or inexact
(a sketch, a quantized dense phase). The values go in the pipeline's codecs where they are lossless;
where its value codec is a deterministic rounding (int8, fp16, bf16), in that format, each entry's
rounding error held (one float per entry of the tensor) and sent with its row's next values, so it
arrives late, not lost; else exactly (`sparsecomm.encode.exact`), since a codec whose error is not
known per entry would lose it. A dense step sends every row exactly in raw codecs, the cheapest to
encode, with the errors held from earlier steps. Never through gloo's sparse all_reduce: with DDP
it can corrupt the heap (the README's known platform issue)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from sparsecomm.adaptive.config import Plan
from sparsecomm.encode.exact import exact_codecs, raw_codecs
from sparsecomm.errors import SparseCommError
from sparsecomm.payload import encode
from sparsecomm.pipeline import screen_nonfinite
from sparsecomm.reducer.call import Call, Route
from sparsecomm.reducer.paths.base import Pending, TransportPath, refused
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.transport.allgather import AllgatherTransport, codecs_of
from sparsecomm.transport.base import Transport
from sparsecomm.transport.request import Request


class RowsPath(TransportPath):
    route = Route.ROWS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.errors: dict[str, torch.Tensor] = {}
        """per sparse gradient sent in a lossy value format: each entry's rounding error, flat"""

    def contribution(self, call: Call, request: Request,
                     plan: Plan | None) -> tuple[Transport, SparseGradient, Request]:
        transport = self.parts.config.spec.transport
        if not transport.exact or transport.name == "dense":
            transport = AllgatherTransport()
        sparse = SparseGradient.from_sparse_coo(call.tensor.detach())
        values, nonfinite = screen_nonfinite(sparse.values, self.parts.config.screening)
        given_index, given_value = codecs_of(request)
        raw = plan is not None and plan.dense  # a dense step sends every row exactly, and cheaply
        index_codec, value_codec = (raw_codecs(sparse.dtype, math.prod(sparse.shape)) if raw
                                    else exact_codecs(given_index, given_value, sparse.dtype))
        rounds = not raw and value_codec is not given_value and given_value.as_decoded(sparse.values[:0]) is not None
        # decided from the dtype, the spec and the agreed plan alone, so every rank's configuration is alike
        request = replace(request, nonfinite=nonfinite, index_codec=index_codec,
                          value_codec=given_value if rounds else value_codec)
        nothing = SparseGradient(sparse.indices[:0], sparse.values[:0], sparse.shape)
        if values is None:
            return transport, nothing, request
        if not rounds:
            errors = self._errors(call.parameter, sparse.indices.device) if raw else None
            if errors is not None:  # the rows' held rounding errors go with them, and are gone
                values = values + errors[sparse.indices]
                errors[sparse.indices] = 0
            return transport, SparseGradient(sparse.indices, values, sparse.shape), request
        try:
            received, payload = self._rounded(call, SparseGradient(sparse.indices, values, sparse.shape), request)
        except SparseCommError as error:  # beyond the format's range: every rank raises
            return transport, nothing, refused(request, error)
        return transport, received, replace(request, payload=payload, payload_is_contribution=True)

    def _rounded(self, call: Call, rows: SparseGradient, request: Request) -> tuple[SparseGradient, bytes]:
        """``rows`` in the request's lossy value format: (what receivers will decode, the payload).
        Each entry's values go with the error it was last sent with, and the new error is held until
        its row is sent again. A value the format cannot carry raises and changes nothing."""
        assert request.index_codec is not None and request.value_codec is not None
        errors = self._errors(call.parameter, rows.indices.device)
        sent = rows.values if errors is None else rows.values + errors[rows.indices]
        received = request.value_codec.as_decoded(sent)
        assert received is not None
        payload = encode(SparseGradient(rows.indices, sent, rows.shape), request.index_codec, request.value_codec,
                         rng=request.rng(self.parts.rank))
        if errors is None:
            errors = self.errors[call.parameter] = torch.zeros(call.tensor.numel(), dtype=sent.dtype,
                                                               device=sent.device)
        errors[rows.indices] = sent - received
        return SparseGradient(rows.indices, received, rows.shape), payload

    def _errors(self, parameter: str, device: torch.device) -> torch.Tensor | None:
        """The parameter's held rounding errors, where its rows are (a checkpoint loaded elsewhere
        moves once)."""
        errors = self.errors.get(parameter)
        if errors is not None and errors.device != device:
            errors = self.errors[parameter] = errors.to(device)
        return errors

    def expected_entries(self, call: Call, plan: Plan | None) -> int | None:
        """None, it always waits: an embedding's rows are ready as the backward pass ends, with little left to
        overlap them with, and how many rows each rank has is not known alike before the exchange."""
        return None

    def after_average(self, call: Call, pending: Pending, total: torch.Tensor) -> torch.Tensor:
        return self.parts.uncompressed.apply(total, call.key, call.segments, whole_only=False)

    def state_dict(self) -> dict[str, Any]:
        return {key: errors.clone() for key, errors in self.errors.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.errors = {key: errors.clone() for key, errors in state.items()}
