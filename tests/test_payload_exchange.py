"""The payload allgather in one round: payloads travel behind their agreement records into buffers of
a capacity every rank holds alike; a payload too large for it follows in a second round; ranks that
disagree still fail together; and the sums are exact and the same bits on every rank."""

import pytest
import torch

import sparsecomm as sc
from helpers import random_sparse
from sparsecomm.launch import run_local
from sparsecomm.transport.payload_exchange import ENVELOPE_BYTES, next_capacity
from sparsecomm.transport.request import Request
from sparsecomm.transport.session import TransportSession

NUMEL = 40_000


def exchanges(rank: int, world: int, sizes: list[int]) -> dict:
    """Calls with ``sizes[i]`` nonzeros on rank 1 (rank 0 sends 50): the capacity before each call, and
    whether each sum equals the sum of the ranks' selections."""
    transport = sc.parse_spec("allgather").transport
    capacities, exact = [], []
    with TransportSession() as session:
        for call, nnz in enumerate(sizes):
            mine = random_sparse(NUMEL, 50 if rank == 0 else nnz, seed=10 * call + rank)
            expected = sum(random_sparse(NUMEL, 50 if r == 0 else nnz, seed=10 * call + r).to_dense()
                           for r in range(world))
            capacities.append(session.payload_capacity)
            total = transport.reduce(mine, request=Request(key="w", call=call), session=session).total
            exact.append(bool(torch.equal(total, expected)))
    return {"capacities": capacities, "exact": exact}


def test_capacity_follows_the_largest_payload_and_one_too_large_still_arrives():
    # call 0: no capacity yet, every payload goes second; calls 1-2 fit; call 3 is 40x larger on rank 1
    results = run_local(2, exchanges, [60, 60, 60, 2400, 60])
    for result in results:
        assert all(result["exact"])
    capacities = results[0]["capacities"]
    assert capacities == results[1]["capacities"]  # the same on every rank
    assert capacities[0] == 0 and capacities[1] > ENVELOPE_BYTES
    assert capacities[4] > 10 * capacities[3]  # grown to the large payload


def test_capacity_leaves_room_for_twice_the_largest_payload_and_shrinks_slowly():
    assert next_capacity(0, [100, 300]) == ENVELOPE_BYTES + 600
    assert next_capacity(16_000, [100]) == 15_000


def disagreeing(rank: int, world: int, what: str) -> str:
    transport = sc.parse_spec("allgather").transport
    with TransportSession() as session:
        for call in range(3):  # a capacity first, so the last call's payloads travel in one round
            key, numel, nonfinite = "w", NUMEL, False
            if call == 2 and rank == 1:
                key = "v" if what == "key" else key
                numel = NUMEL + 1 if what == "size" else numel
                nonfinite = what == "nonfinite"
            try:
                transport.reduce(random_sparse(numel, 30, seed=rank), request=Request(key=key, call=call,
                                                                                     nonfinite=nonfinite),
                                 session=session)
            except sc.SparseCommError as err:
                return str(err)
    return "no error"


@pytest.mark.parametrize(("what", "message"), [("key", "different tensors"), ("size", "disagree on tensor size"),
                                               ("nonfinite", "non-finite")])
def test_ranks_that_disagree_fail_together_with_the_agreement_steps_message(what, message):
    errors = run_local(2, disagreeing, what)
    assert all(message in error for error in errors), errors


def test_an_announced_size_no_codec_can_produce_is_refused():
    from sparsecomm.transport.allgather import _check_sizes

    _check_sizes([100, 5000], numel=1000)
    with pytest.raises(sc.SparseCommError, match="announced a payload"):
        _check_sizes([100, 10**9], numel=1000)
