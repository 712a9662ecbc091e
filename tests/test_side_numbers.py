"""Side numbers: a few float64 values per rank that ride on collectives already run — in every
transport's agreement record, or in a tail of a dense all_reduce — come back to every rank bit for
bit; and the adaptive budget's reports ride on them, so after the first a step's report needs no
collective of its own."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from helpers import random_sparse
from sparsecomm.adaptive.report import Report
from sparsecomm.adaptive.report_exchange import ReportExchange
from sparsecomm.launch import run_local
from sparsecomm.transport.request import Request
from sparsecomm.transport.session import TransportSession
from sparsecomm.transport.side_numbers import SIDE_FIELDS, read_tail, side_words, tail_elements, write_tail
from test_adaptive_reducer import CORRECTED, MODEL_BYTES
from test_training import batches, mlp

AWKWARD = (0.1, -0.0, math.inf, -math.inf, 5e-324, 1.7976931348623157e308, -123456.789, 3.0)


def sides_of(rank: int) -> tuple[float, ...]:
    return tuple(value * (rank + 1) if math.isfinite(value) else value for value in AWKWARD) + (float(rank),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_summed_tail_gives_back_every_ranks_numbers_bit_for_bit_in_any_wire_dtype(dtype):
    world = 3
    tails = []
    for rank in range(world):
        tail = torch.empty(tail_elements(world), dtype=dtype)
        write_tail(tail, sides_of(rank), rank)
        tails.append(tail)
    for order in ([0, 1, 2], [2, 0, 1]):  # however the backend orders its additions
        total = torch.zeros(tail_elements(world), dtype=dtype)
        for rank in order:
            total += tails[rank]
        read = read_tail(total)
        for rank in range(world):
            expected = torch.zeros(SIDE_FIELDS, dtype=torch.float64)
            expected[:len(sides_of(rank))] = torch.tensor(sides_of(rank), dtype=torch.float64)
            assert torch.equal(read[rank].view(torch.int64), expected.view(torch.int64))


def test_more_side_numbers_than_a_call_carries_are_refused():
    with pytest.raises(sc.SparseCommError, match="at most"):
        side_words(tuple(range(SIDE_FIELDS + 1)))
    assert len(Report().numbers()) <= SIDE_FIELDS  # every report fits a call


TRANSPORTS = ["dense", "allgather", "sparse_allreduce(algorithm=ssar_rd)", "sparse_allreduce(algorithm=ssar_sa)",
              "sketch_allreduce(ratio=4)", "auto"]


def sides_through_transports(rank: int, world: int) -> dict:
    seen = {}
    with TransportSession() as session:
        for call, name in enumerate(TRANSPORTS):
            transport = sc.parse_spec(name).transport
            grad = random_sparse(20_000, 100, seed=rank)
            contribution = grad.to_dense() if name == "dense" else grad
            request = Request(key=name, call=call, side=sides_of(rank))
            agreement = transport.reduce(contribution, request=request, session=session).record.agreement
            seen[name] = agreement.sides.clone()
    return seen


def test_every_transport_brings_every_ranks_side_numbers_back_from_its_agreement_step():
    results = run_local(2, sides_through_transports)
    for name in TRANSPORTS:
        for result in results:
            sides = result[name]
            for rank in range(2):
                expected = torch.tensor(sides_of(rank) + (0.0,) * (SIDE_FIELDS - len(sides_of(rank))),
                                        dtype=torch.float64)
                assert torch.equal(sides[rank].view(torch.int64), expected.view(torch.int64)), name


def reports_over_steps(rank: int, world: int) -> list[list[float]]:
    """Step 0's report goes alone; steps 1 and 2's ride on the next step's dense call; each is read
    two steps later as the maximum over the ranks."""
    reports = ReportExchange(None, torch.device("cpu"))
    observed = []
    for step in range(5):
        observed += [list(report.numbers()[:3]) for _, report in reports.ready(step, first=step == 1)]
        side = reports.take()
        grad = torch.ones(5000)
        request = Request(key="g", call=step, side=side or ())
        reduction = sc.parse_spec("dense").transport.reduce(grad, request=request)
        if side is not None:
            reports.carried(reduction.record.agreement.sides)
        report = Report(float(step), float(10 * rank + step), -float(rank))
        reports.end_step(step, report, needed=False, first=step == 0)
    reports.close()
    return observed


def test_each_report_reaches_every_rank_as_the_maximum_two_steps_later():
    results = run_local(2, reports_over_steps)
    assert results[0] == results[1]
    # read at steps 1 (the first, at once), 3 and 4
    assert results[0] == [[0.0, 10.0, 0.0], [1.0, 11.0, 0.0], [2.0, 12.0, 0.0]]


def adaptive_reports(rank: int, world: int, spec: str, steps: int) -> dict:
    model = DDP(mlp(0), bucket_cap_mb=0.05)  # several buckets: the first carries
    reducer = sc.register_ddp_hook(model, spec)
    alone = []
    send_alone = reducer.adaptive.reports.send_alone

    def counted(step: int, report: Report) -> None:
        alone.append(step)
        send_alone(step, report)

    reducer.adaptive.reports.send_alone = counted  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for data, labels in batches(rank, world, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
    reducer.close()
    dist.barrier()
    return {"alone": alone, "read": reducer.adaptive.planner.reports_read,
            "modes": {str(mode): count for mode, count in reducer.adaptive.planner.mode_steps.items()}}


@pytest.mark.parametrize(("budget", "mode"), [(MODEL_BYTES, "fp32"), (MODEL_BYTES // 2, "fp16"), (20000, "sparse")])
def test_after_the_first_every_steps_report_rides_on_the_next_steps_first_call(budget, mode):
    steps = 10
    results = run_local(2, adaptive_reports, f"adaptive(budget={budget})+{CORRECTED}", steps)
    assert results[0] == results[1]
    assert results[0]["modes"][mode] >= steps - 1  # a tail on an fp32 or fp16 wire, or an agreement record
    assert results[0]["alone"] == [0]
    assert results[0]["read"] == steps - 2  # steps 0 … steps−3: the last two are still on their way
