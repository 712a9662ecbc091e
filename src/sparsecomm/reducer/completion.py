"""`complete`: what every call's sum goes through once its collective is done — the statistics, the
report it carried, the adaptive controller's measurements, the path's check, the average over
ranks, what the feedback owns, and the gradient's own shape and kind. Errors reach the call's
result, never the thread that finished it."""

from __future__ import annotations

import math
import time

import torch

from sparsecomm.errors import NonFiniteError, SparseCommError
from sparsecomm.reducer.call import Call
from sparsecomm.reducer.paths.base import Parts, Path, Pending
from sparsecomm.reducer.stats import TensorStats
from sparsecomm.sparse_gradient import nonzero_rows


def result_future(tensor: torch.Tensor) -> torch.futures.Future:
    """The future a call's average is handed back in. For a CUDA gradient it knows the device, so that
    setting it records the setter's stream and a waiter's stream waits for that work: the callbacks
    of c10d's futures run on side streams, and DDP copies the sum into the gradients on its own."""
    return torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda" else torch.futures.Future()


def attach(parts: Parts, call: Call, path: Path, pending: Pending, stats: TensorStats) -> torch.futures.Future:
    """The future of the call's average: completed when its collective is (by the thread that
    finishes the step, where the path asks for that)."""
    result = result_future(call.tensor)

    def finish(done: torch.futures.Future) -> None:
        # not Future.then: it would wrap a SparseCommError in a RuntimeError
        try:
            result.set_result(complete(parts, call, path, pending, stats, done))
        except BaseException as err:  # noqa: BLE001 - handed to the waiter
            result.set_exception(err)

    if pending.finish_with_step:
        parts.calls.finish_with_step(pending.future, finish)
    else:
        pending.future.add_done_callback(finish)
    parts.calls.track(result, call.in_step)
    return result


def complete(parts: Parts, call: Call, path: Path, pending: Pending, stats: TensorStats,
             done: torch.futures.Future) -> torch.Tensor:
    """The call's average over ranks, in the gradient's shape, dtype and kind."""
    try:
        summed = path.summed(call, pending, done)
        stats.transport_s += time.perf_counter() - pending.submitted
        stats.decode_s += summed.decode_s
        stats.bytes_sent += summed.bytes_sent
        if parts.adaptive is not None:
            if summed.carried_report:
                parts.adaptive.reports.carried(summed.sides)
            path.measured(call, pending, summed)
        total = path.checked(call, pending, summed)
    except SparseCommError as error:  # every rank raises at this call, and none applies it
        path.withdrawn(call, pending)
        if isinstance(error, NonFiniteError) and parts.config.nonfinite == "propagate":
            return not_a_number(call)  # as DDP's own all_reduce would sum it: a GradScaler skips the step
        raise
    if summed.lost is not None:
        path.take_back(call, summed.lost)
    world_size = parts.config.world_size
    if summed.averaged:  # scaled by 1/P before it was sent
        if not parts.config.average:
            total.mul_(world_size)
    elif parts.config.average:
        total = total.div_(world_size) if summed.owned else total / world_size
    total = path.after_average(call, pending, total)
    total = total.reshape(call.tensor.shape).to(call.tensor.dtype)
    return nonzero_rows(total, call.sparse_dim) if call.sparse_dim else total


def not_a_number(call: Call) -> torch.Tensor:
    """A call's average under ``nonfinite="propagate"`` where its sum was non-finite, in its
    gradient's shape, dtype and kind: NaN in every entry of a dense gradient; a sparse one's first
    row NaN, the same on every rank whatever rows it had (a GradScaler looks for one NaN)."""
    tensor, sparse_dim = call.tensor, call.sparse_dim
    if not sparse_dim:
        return torch.full_like(tensor, math.nan)
    first = torch.zeros(sparse_dim, 1, dtype=torch.int64, device=tensor.device)
    row = torch.full((1, *tensor.shape[sparse_dim:]), math.nan, dtype=tensor.dtype, device=tensor.device)
    return torch.sparse_coo_tensor(first, row, tensor.shape, is_coalesced=True, check_invariants=False)  # row 0: sound
