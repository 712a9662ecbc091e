"""``plain``: the tensor as it is, summed by an fp32 all_reduce (the spec's ``dense`` transport
where that is the pipeline's) — no feedback, no sparsifier: small tensors, whose compression would
save nothing, and every tensor of a ``dense`` pipeline."""

from __future__ import annotations

from dataclasses import replace

import torch

from sparsecomm.adaptive.config import Plan
from sparsecomm.pipeline import screen_nonfinite
from sparsecomm.reducer.call import Call, Route
from sparsecomm.reducer.paths.base import Pending, TransportPath
from sparsecomm.transport.base import Transport
from sparsecomm.transport.dense import DenseTransport
from sparsecomm.transport.request import Request


class PlainPath(TransportPath):
    route = Route.PLAIN

    def contribution(self, call: Call, request: Request, plan: Plan | None) -> tuple[Transport, torch.Tensor, Request]:
        config = self.parts.config
        screened, nonfinite = screen_nonfinite(call.tensor.detach(), config.screening)
        dense = screened if screened is not None else torch.zeros_like(call.tensor)
        transport = config.spec.transport if config.spec.transport.name == "dense" else DenseTransport()
        return transport, dense, replace(request, nonfinite=nonfinite)

    def after_average(self, call: Call, pending: Pending, total: torch.Tensor) -> torch.Tensor:
        return self.parts.uncompressed.apply(total, call.key, call.segments, whole_only=False)
