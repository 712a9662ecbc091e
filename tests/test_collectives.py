"""The byte collectives under the transports, on real multi-process gloo groups: every rank gets
exactly what each peer sent it, empty buffers included, and point-to-point transfers post every
receive before any send (on gloo that order lets both directions of a link run at once), even
before the rank knows what it will send."""

import torch
import torch.distributed as dist

from sparsecomm.launch import run_local
from sparsecomm.transport import collectives


def buffer(sender: int, receiver: int, size: int) -> torch.Tensor:
    """What ``sender`` sends ``receiver``: sizes vary per pair, and some are empty."""
    length = 0 if (sender + receiver) % 3 == 0 else 1000 * sender + 37 * receiver + 1
    return torch.arange(length, dtype=torch.int64).add(sender * 7 + receiver).remainder(251).to(torch.uint8)


def exchanges(rank: int, world: int) -> dict:
    own = buffer(rank, rank, world)
    gathered = collectives.allgather_bytes(own, None)
    with_counts = collectives.allgather_bytes(own, None, counts=[buffer(r, r, world).numel() for r in range(world)])
    received = collectives.alltoall_bytes([buffer(rank, peer, world) for peer in range(world)], None)
    peer = rank ^ 1
    swapped = collectives.exchange_bytes(buffer(rank, peer, world), peer, None) if peer < world else None
    return {
        "allgather": all(torch.equal(g, buffer(r, r, world)) for r, g in enumerate(gathered)),
        "allgather_with_counts": all(torch.equal(g, buffer(r, r, world)) for r, g in enumerate(with_counts)),
        "alltoall": all(torch.equal(g, buffer(r, rank, world)) for r, g in enumerate(received)),
        "exchange": swapped is None or torch.equal(swapped, buffer(peer, rank, world)),
        "has_empty": any(buffer(r, rank, world).numel() == 0 for r in range(world)),
    }


def test_every_rank_gets_what_each_peer_sent_it_empty_buffers_included():
    for world in (2, 3, 4):
        results = run_local(world, exchanges)
        assert any(r["has_empty"] for r in results)
        for rank, result in enumerate(results):
            assert result == {**result, "allgather": True, "allgather_with_counts": True, "alltoall": True,
                              "exchange": True}, (world, rank)


def posting_order(rank: int, world: int) -> list[list[str]]:
    batches: list[list[str]] = []
    original = dist.batch_isend_irecv

    def recording(ops):
        batches.append(["recv" if op.op is dist.irecv else "send" for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        collectives.allgather_bytes(buffer(rank, rank, world) if rank else torch.ones(5, dtype=torch.uint8), None)
        collectives.exchange_bytes(torch.ones(100, dtype=torch.uint8), rank ^ 1, None)
    finally:
        dist.batch_isend_irecv = original
    return batches


def test_point_to_point_transfers_post_every_receive_before_any_send():
    for batches in run_local(2, posting_order):
        assert len(batches) == 3  # the allgather's buffers; the exchange's sizes, then its data
        for ops in batches:
            assert ops == ["recv"] * ops.count("recv") + ["send"] * ops.count("send") and "send" in ops


def receive_before_sending(rank: int, world: int) -> bool:
    """Rank 0 posts its receive, waits for rank 1's message, and only then sends its own; rank 1 sends
    at once. A receive posted ahead of the rank's own send completes on the peer's send alone."""
    peer = 1 - rank
    message = torch.arange(64, dtype=torch.uint8).add(100 * rank)
    received = torch.empty(64, dtype=torch.uint8)
    arrivals = collectives.Arrivals({peer: received}, {}, None)
    if rank == 0:
        arrived = list(arrivals)
        arrivals.send({peer: message})
        arrivals.close()
    else:
        arrivals.send({peer: message})
        arrived = list(arrivals)
    return arrived == [peer] and torch.equal(received, torch.arange(64, dtype=torch.uint8).add(100 * peer))


def test_receives_posted_ahead_of_the_sends_complete_on_the_peers_send_alone():
    assert run_local(2, receive_before_sending) == [True, True]
