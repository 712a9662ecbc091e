"""Inexact transports on real gloo groups — S2's sketch, SparCML's quantized dense phase, the
split-allgather that keeps a global top-k: what a call loses comes back to the ranks (summed over
ranks, exactly what the sum lost), the feedback sends it again so that over steps nothing is lost,
and peeling reads a wide enough sketch exactly."""

import pytest
import torch
import torch.distributed as dist

import sparsecomm as sc
from helpers import contribution, fed_and_conserved
from sparsecomm.launch import run_local
from sparsecomm.transport.request import Request

LOSSY = ["sketch_allreduce(ratio=8)", "sketch_allreduce(ratio=24,block=4)",
         "sketch_allreduce(ratio=0.5,rows=3,block=4,decode=peel)"]


def sketch_losses(rank: int, world: int, spec: str) -> dict:
    grad = contribution(rank, world, "random", numel=5000, nnz=200)
    reference = grad.clone()
    dist.all_reduce(reference)
    reduction = sc.parse_spec(spec).transport.reduce(sc.SparseGradient.from_dense(grad), request=Request(step=3))
    lost = reduction.lost.to_dense().reshape(-1) if reduction.lost is not None else torch.zeros(5000)
    dist.all_reduce(lost)
    return {"error": reference - reduction.total, "lost": lost}


@pytest.mark.parametrize("spec", LOSSY)
def test_what_the_sketch_loses_of_each_rank_sums_to_what_the_sum_lost(spec):
    for result in run_local(3, sketch_losses, spec):
        assert float(result["error"].abs().max()) > 0.1  # the sketch is too narrow to be exact
        torch.testing.assert_close(result["lost"], result["error"], rtol=0, atol=1e-4)


def test_a_read_noisier_than_what_a_rank_sent_is_not_fed_back():
    """At the paper's λ = 0.5 on three ranks each read sums about six entries: sent again, the
    noise would compound step by step."""
    assert all(lost is None for lost in run_local(3, lost_at_half))


def lost_at_half(rank: int, world: int) -> sc.SparseGradient | None:
    grad = contribution(rank, world, "random", numel=5000, nnz=200)
    return sc.parse_spec("sketch_allreduce(ratio=0.5)").transport.reduce(sc.SparseGradient.from_dense(grad)).lost


@pytest.mark.parametrize("block", [1, 8])
def test_peeling_reads_a_wide_enough_sketch_exactly(block):
    """Sized by the entries of the marked blocks (eight per selected entry at block 8), not the
    selected entries alone."""
    for result in run_local(3, sketch_losses, f"sketch_allreduce(ratio=1.6,rows=3,block={block},decode=peel)"):
        assert float(result["error"].abs().max()) < 1e-5
        assert float(result["lost"].abs().max()) == 0.0


def conserved(rank: int, world: int, spec: str) -> dict:
    return fed_and_conserved(sc.GradientReducer(spec), rank, world, numel=8000, steps=5)


@pytest.mark.parametrize("transport", ["sketch_allreduce(ratio=8)", "sketch_allreduce(ratio=0.5,rows=3,decode=peel)",
                                       "sparse_allreduce(algorithm=topk_sa)"])
def test_error_feedback_keeps_what_the_sketch_lost_so_nothing_is_lost_over_steps(transport):
    """Over steps, what every rank was given plus what every rank's residual holds is what they fed
    in: the sketch's collisions (and unsolved entries) are sent again, not dropped."""
    results = run_local(2, conserved, f"topk(ratio=0.05)+residual+raw+fp32+{transport}")
    for result in results:
        # float32 rounding of what was delivered and held, each larger than what was fed
        torch.testing.assert_close(result["delivered_and_held"], result["fed"], rtol=0, atol=1e-6 * result["scale"])


def quantized_losses(rank: int, world: int) -> dict:
    grad = contribution(rank, world, "random", numel=5000, nnz=200)
    reference = grad.clone()
    dist.all_reduce(reference)
    transport = sc.parse_spec("sparse_allreduce(algorithm=dsar_sa,qsgd_bits=4,bucket=64)").transport
    reduction = transport.reduce(sc.SparseGradient.from_dense(grad), request=Request(step=1))
    assert reduction.lost is not None
    lost = reduction.lost.to_dense().reshape(-1)
    dist.all_reduce(lost)
    return {"error": reference - reduction.total, "lost": lost}


def test_what_sparcmls_quantized_dense_phase_loses_comes_back_to_the_ranks():
    for result in run_local(3, quantized_losses):
        assert float(result["error"].abs().max()) > 0.01
        kept = result["lost"] != 0  # the quantizer's buckets whose error is smaller than what they carry
        assert int(kept.sum()) > 0.5 * int((result["error"] != 0).sum())
        torch.testing.assert_close(result["lost"][kept], result["error"][kept], rtol=0, atol=1e-5)


def test_a_quantized_bucket_noisier_than_what_it_carries_is_not_fed_back():
    from sparsecomm.transport.sparse_allreduce import contracting_error

    exact = torch.tensor([1.0, 1.1, 0.9, 1.0, 0.1, 0.1, 0.1, 0.1])
    decoded = torch.tensor([1.2, 1.0, 1.0, 0.8, 1.0, 0.0, 0.0, 1.0])  # rounded to 0 or a coarse step
    error = contracting_error(exact, decoded, bucket=4)
    torch.testing.assert_close(error[:4], exact[:4] - decoded[:4])
    assert float(error[4:].abs().max()) == 0.0


def test_a_rank_that_holds_nothing_yet_keeps_what_was_lost():
    """A rank that skipped its non-finite gradient (``nonfinite="skip"``) has no residual yet when
    the call's loss comes back."""
    from sparsecomm.feedback.residual import Residual

    state: dict = {}
    Residual().take_back(sc.SparseGradient(torch.tensor([1, 3]), torch.tensor([0.5, -1.0]), torch.Size([5])), state)
    assert state["residual"].tolist() == [0.0, 0.5, 0.0, -1.0, 0.0]


def global_top_k(rank: int, world: int, nnz: int) -> dict:
    grad = contribution(rank, world, "random", numel=6000, nnz=nnz)
    reference = grad.clone()
    dist.all_reduce(reference)
    transport = sc.parse_spec("sparse_allreduce(algorithm=topk_sa)").transport
    reduction = transport.reduce(sc.SparseGradient.from_dense(grad), request=Request(step=1))
    lost = reduction.lost.to_dense().reshape(-1) if reduction.lost is not None else torch.zeros(6000)
    dist.all_reduce(lost)
    return {"reference": reference, "total": reduction.total, "lost": lost, "sent": reduction.record.bytes_sent,
            "nnz": int(torch.count_nonzero(grad))}


@pytest.mark.parametrize("world", [2, 3])
def test_the_split_allgather_keeps_a_global_top_k_and_gives_back_the_rest(world):
    """Each owner sends on the ⌈k/P⌉ largest sums of its range: the result holds about one rank's
    selection, its entries are exact, no dropped sum of a range is larger than a kept one, and what
    the owners keep summed over ranks is all the sum lost."""
    results = run_local(world, global_top_k, 300)
    totals = [result["total"] for result in results]
    assert all(torch.equal(total, totals[0]) for total in totals)  # every rank the same bits
    result = results[0]
    reference, total = result["reference"], result["total"]
    kept = total != 0
    assert int(kept.sum()) <= world * -(-max(r["nnz"] for r in results) // world)
    assert int((reference != 0).sum()) > 1.5 * int(kept.sum())  # the ranks' union is larger: something dropped
    torch.testing.assert_close(total[kept], reference[kept], rtol=0, atol=1e-6)
    torch.testing.assert_close(result["lost"], reference - total, rtol=0, atol=1e-6)
    for lo in range(0, 6000, 6000 // world):  # equal ranges
        span = slice(lo, lo + 6000 // world)
        smallest_kept = total[span][kept[span]].abs().min()
        assert float(result["lost"][span].abs().max()) <= float(smallest_kept)


def test_what_a_rank_of_the_global_top_k_sends_stays_near_its_own_selection():
    """Each rank sends its selection by range (all but its own share) and its range's top entries
    to the others: about twice a selection at any P, where a payload allgather's receiver takes P − 1."""
    for world in (2, 4):
        for result in run_local(world, global_top_k, 400):
            selection = result["nnz"] * 8  # 32-bit index and value
            assert 0.9 * selection * (world - 1) / world < result["sent"] < 2.1 * selection
