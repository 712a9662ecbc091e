"""Transports on real multi-process gloo groups (started by the tests): lossless transports equal a
dense all_reduce of the same inputs, every rank gets the same bits, empty selections never hang,
mismatched ranks fail clearly, and the sketch transport is unbiased."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import sparsecomm as sc
from sparsecomm.launch import WorkerError, run_local
from sparsecomm.transport.streams import Stream

EXACT = ["allgather", "dense", "auto", "auto(explore=0)", "sparse_allreduce(algorithm=ssar_rd)",
         "sparse_allreduce(algorithm=ssar_sa)", "sparse_allreduce(algorithm=dsar_sa)", "sparse_allreduce"]
OVERLAPS = ["random", "none", "full", "rank0_empty", "all_empty", "dense_result"]


def contribution(rank: int, world: int, overlap: str, numel: int = 20_000, nnz: int = 150) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    grad = torch.zeros(numel)
    if overlap == "random":
        indices = torch.randperm(numel, generator=generator)[:nnz]
    elif overlap == "none":
        indices = torch.arange(rank, nnz * world, world)
    elif overlap == "full":
        indices = torch.randperm(numel, generator=torch.Generator().manual_seed(7))[:nnz]
    elif overlap == "rank0_empty":
        indices = torch.randperm(numel, generator=generator)[: (0 if rank == 0 else nnz)]
    elif overlap == "all_empty":
        indices = torch.zeros(0, dtype=torch.int64)
    else:  # dense_result: enough nonzeros that the reduced streams switch to dense
        indices = torch.randperm(numel, generator=generator)[: numel // 3]
    grad[indices] = torch.randn(indices.numel(), generator=generator)
    return grad


def exact_scenarios(rank: int, world: int) -> dict:
    errors, digests = {}, {}
    session = sc.TransportSession()
    for overlap in OVERLAPS:
        grad = contribution(rank, world, overlap)
        reference = grad.clone()
        dist.all_reduce(reference)
        for text in EXACT:
            transport = sc.parse_spec(text).transport
            request = sc.Request(index_codec=sc.INDEX_CODECS.create("rice"))
            result = transport.allreduce(sc.SparseGradient.from_dense(grad), request=request, session=session)
            asynchronous = transport.reduce_async(sc.SparseGradient.from_dense(grad), session=session).wait().total
            errors[(overlap, text)] = float((result - reference).abs().max())
            if text == "auto":  # exploring: consecutive calls may sum in another order
                torch.testing.assert_close(asynchronous, result, rtol=0, atol=1e-5)
            else:
                assert torch.equal(asynchronous, result), (overlap, text)
            digests[(overlap, text)] = result.numpy().tobytes()
    session.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, digests)
    identical = all(g == gathered[0] for g in gathered)
    return {"errors": errors, "identical": identical}


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_lossless_transports_equal_a_dense_allreduce_on_every_rank(world):
    results = run_local(world, exact_scenarios, timeout=240)
    for rank_result in results:
        assert rank_result["identical"], "ranks got different bits"
        for (overlap, text), error in rank_result["errors"].items():
            assert error <= 1e-5, f"{text} with {overlap} overlap is off by {error}"


def lossy_scenarios(rank: int, world: int) -> dict:
    grad = contribution(rank, world, "random")
    reference = grad.clone()
    dist.all_reduce(reference)
    out = {}
    for bits in (8, 4):
        transport = sc.parse_spec(f"sparse_allreduce(algorithm=dsar_sa,qsgd_bits={bits},bucket=1024)").transport
        result = transport.allreduce(grad, request=sc.Request(seed=1))
        out[bits] = float((result - reference).norm() / reference.norm())
    return out


def test_dsar_with_qsgd_dense_phase_is_close_and_coarser_with_fewer_bits():
    errors = run_local(2, lossy_scenarios)[0]
    assert 0 < errors[8] < errors[4] < 0.5


def mismatched(rank: int, world: int, kind: str) -> str:
    if kind == "size":
        grad, transport = torch.ones(100 + rank), sc.parse_spec("sparse_allreduce(algorithm=ssar_rd)").transport
    else:
        grad = torch.ones(100)
        transport = sc.parse_spec("sparse_allreduce(algorithm=ssar_rd)" if rank else "allgather").transport
    try:
        transport.allreduce(grad)
    except sc.SparseCommError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("kind", ["size", "spec"])
def test_ranks_that_disagree_fail_clearly_instead_of_hanging(kind):
    messages = run_local(3, mismatched, kind, timeout=60)
    assert all("ranks disagree" in message for message in messages)


def sketch_trials(rank: int, world: int, ratio: float, rows: int, trials: int) -> dict:
    grad = contribution(rank, world, "random", numel=5000, nnz=50)
    reference = grad.clone()
    dist.all_reduce(reference)
    transport = sc.parse_spec(f"sketch_allreduce(ratio={ratio},rows={rows})").transport
    outputs = torch.stack([transport.allreduce(grad, request=sc.Request(step=t)) for t in range(trials)])
    return {"outputs": outputs, "reference": reference}


def test_sketch_allreduce_is_unbiased_over_hash_seeds():
    result = run_local(2, sketch_trials, 0.5, 1, 300)[0]
    outputs, reference = result["outputs"], result["reference"]
    support = reference != 0
    mean_error = (outputs.mean(0) - reference)[support]
    std_of_mean = outputs.std(0)[support] / outputs.shape[0] ** 0.5
    z = mean_error / std_of_mean.clamp_min(1e-6)
    assert abs(float(z.mean())) < 0.25  # 100 supported entries: mean of z has std 0.1 when unbiased
    assert float(z.abs().mean()) < 1.0
    assert float((outputs[0] - reference).abs().max()) > 0.01  # λ = 0.5 really is lossy


def test_sketch_allreduce_is_exact_when_wide_enough():
    result = run_local(3, sketch_trials, 20_000.0, 3, 1)[0]
    torch.testing.assert_close(result["outputs"][0], result["reference"], rtol=0, atol=1e-6)


def test_a_failing_worker_reports_its_rank_and_traceback():
    with pytest.raises(WorkerError, match="rank 1"):
        run_local(2, _fail_on_rank_one)


def test_a_failed_worker_does_not_leave_the_others_running_until_the_timeout():
    # rank 1 raises while rank 0 is busy for another minute: run_local stops it after a short grace
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank one fails"):
        run_local(2, _fail_on_rank_one_while_rank_zero_works, timeout=600)
    assert time.monotonic() - start < 40


def test_a_worker_that_dies_without_reporting_is_named_and_the_others_stopped():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1: exited with code 3"):
        run_local(2, _die_on_rank_one_while_rank_zero_works, timeout=600)
    assert time.monotonic() - start < 40


def test_worker_results_are_copies_that_outlive_the_worker():
    # A tensor passed through torch's shared-memory pickler lives in a file descriptor of the worker;
    # if the worker exits first, reading it fails. Results must arrive by value instead.
    results = run_local(2, _return_a_tensor)
    for rank, tensor in enumerate(results):
        assert not tensor.is_shared()
        torch.testing.assert_close(tensor, torch.arange(1000, dtype=torch.float32) + rank)


def _fail_on_rank_one_while_rank_zero_works(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails")
    time.sleep(60)


def _die_on_rank_one_while_rank_zero_works(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def _return_a_tensor(rank: int, world: int) -> torch.Tensor:
    return torch.arange(1000, dtype=torch.float32) + rank


def _fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("boom")


def test_streams_switch_to_dense_exactly_at_delta():
    """δ = N·isize/(c + isize): fp32 values with int32 indices switch at N/2 nonzeros."""
    numel = 1000
    below = Stream.sparse(torch.arange(499), torch.ones(499), numel)
    at = Stream.sparse(torch.arange(500), torch.ones(500), numel)
    assert not below.is_dense and at.is_dense
    assert below.switch_point() == 500.0
    half = Stream.sparse(torch.arange(0, 1000, 2), torch.ones(500), numel)
    assert half.is_dense and torch.equal(half.to_dense()[:4], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    fp16 = Stream.sparse(torch.arange(333), torch.ones(333, dtype=torch.float16), numel)
    assert not fp16.is_dense and Stream.sparse(torch.arange(334), torch.ones(334, dtype=torch.float16), numel).is_dense


def test_stream_sums_switch_when_the_union_grows():
    numel = 100
    a = Stream.sparse(torch.arange(0, 30), torch.ones(30), numel)
    b = Stream.sparse(torch.arange(30, 60), torch.ones(30), numel)
    assert not a.is_dense and (a + b).is_dense
    c = Stream.sparse(torch.arange(0, 30), torch.ones(30), numel)
    assert not (a + c).is_dense and torch.equal((a + c).to_dense()[:30], torch.full((30,), 2.0))


def test_stream_bytes_round_trip_and_reject_corruption():
    stream = Stream.sparse(torch.tensor([3, 9]), torch.tensor([1.5, -2.0]), 50, offset=100)
    again = Stream.from_bytes(stream.to_bytes())
    assert again.offset == 100 and torch.equal(again.to_dense(), stream.to_dense())
    broken = stream.to_bytes().clone()
    broken[-12] = 200  # an index beyond the range
    with pytest.raises(sc.PayloadError):
        Stream.from_bytes(broken)
    with pytest.raises(sc.PayloadError):
        Stream.from_bytes(stream.to_bytes()[:-1])


def test_cost_model_switches_algorithms_where_the_formulas_say():
    wire_only = sc.CostModel(alpha=50e-6, beta=1 / 125e6, codec_per_nnz=0, pass_per_byte=0, sort_per_entry=0,
                             hash_per_entry=0)  # 1 Gbit/s, compute free: SparCML's formulas alone
    numel = 16_000_000
    assert wire_only.best_sparse_algorithm(8, numel, 1_000) == "ssar_rd"  # small result: latency decides
    assert wire_only.best_sparse_algorithm(8, numel, 1_000_000) in ("ssar_sa", "dsar_sa")  # result 40% dense
    assert wire_only.best_sparse_algorithm(8, numel, 1_000_000, qsgd_bits=4) == "dsar_sa"  # quantized dense phase
    assert wire_only.dense(4, numel) > 3 * wire_only.ssar_rd(4, numel, 160_000)  # 1% density: sparse wins big
    for nnz in (1_000, 160_000, 4_000_000):
        assert wire_only.lower_bound(4, numel, nnz) <= min(wire_only.sparse_algorithms(4, numel, nnz).values())
    assert wire_only.expected_union(1000, 10, 2) == pytest.approx(1000 * (1 - 0.99**2))
    slow_codec = sc.CostModel(alpha=50e-6, beta=1 / 125e6, codec_per_nnz=100e-9)
    assert slow_codec.best_sparse_algorithm(8, numel, 1_000_000, qsgd_bits=4) != "dsar_sa"  # QSGD costs more


def auto_choices(rank: int, world: int) -> list:
    grad = contribution(rank, world, "random", numel=50_000, nnz=500)
    transport = sc.parse_spec("auto(explore=2)").transport
    chosen = []
    with sc.TransportSession() as session:
        for _ in range(30):
            chosen.append(transport.reduce(grad, session=session).record.transport)
    (tuning,) = session.tunings.values()
    return [chosen, tuning.candidates, tuning.chosen, sum(map(len, tuning.seconds.values()))]


def test_auto_explores_its_shortlist_then_keeps_the_fastest_on_every_rank():
    results = run_local(3, auto_choices)
    assert all(r == results[0] for r in results)  # every rank explored and chose alike
    chosen, candidates, winner, explored = results[0]
    assert 2 * len(candidates) <= explored <= 2 * len(candidates) + 2 * 2 * 4  # a near-tie: 2 finalists to 10 each
    assert 1 <= len(candidates) <= 3 and winner in candidates
    assert {c.replace("dense(dtype=fp32)", "dense") for c in chosen[:explored]} <= set(candidates) | {"dense"}
    assert len(set(chosen[explored:])) == 1  # settled


def test_tuning_keeps_the_lowest_median_time():
    from sparsecomm.transport.tuning import Tuning

    tuning = Tuning(["a", "b", "c"])
    trials = [("a", 3.0), ("b", 9.0), ("c", 1.0), ("a", 3.0), ("b", 2.0), ("c", 5.0), ("a", 3.0), ("b", 2.0),
              ("c", 5.0)]
    for name, seconds in trials:
        assert tuning.next_to_try(3) == name
        assert tuning.chosen is None
        tuning.record(name, seconds, 3)
    # b's 9.0 was a spike (median 2.0 beats a's 3.0); c's one fast trial does not make it the fastest
    assert tuning.chosen == "b"
    assert tuning.next_to_try(3) is None


def test_tuning_breaks_a_near_tie_with_more_trials_of_the_two_best():
    from sparsecomm.transport.tuning import Tuning

    tuning = Tuning(["a", "b", "c"])
    for name, seconds in [("a", 1.00), ("b", 1.05), ("c", 3.0), ("a", 1.00), ("b", 1.05), ("c", 3.0)]:
        tuning.record(name, seconds, 2)
    assert tuning.chosen is None and tuning.finalists == ["a", "b"]  # 5% apart after 2 trials each
    for _ in range(8):  # to 5 × 2 trials each, interleaved; b is the faster one after all
        for name, seconds in [("a", 1.20), ("b", 0.90)]:
            assert tuning.next_to_try(2) == name
            tuning.record(name, seconds, 2)
    assert tuning.chosen == "b" and tuning.next_to_try(2) is None


def test_tuning_keeps_the_models_ranking_where_medians_are_noise_apart():
    from sparsecomm.transport.tuning import Tuning

    tuning = Tuning(["a", "b"])  # the model ranks a first
    for name, seconds in [("a", 1.04), ("b", 1.00)] * 10:  # 4% apart, after the near-tie trials too
        tuning.record(name, seconds, 2)
    assert tuning.chosen == "a"
    tuning = Tuning(["a", "b"])
    for name, seconds in [("a", 1.08), ("b", 1.00)] * 10:  # 8% apart: measurement overrules the model
        tuning.record(name, seconds, 2)
    assert tuning.chosen == "b"


def into_out(rank: int, world: int) -> bool:
    grad = contribution(rank, world, "random")
    reference = grad.clone()
    dist.all_reduce(reference)
    ok = True
    for text in EXACT + ["sketch_allreduce(ratio=20000.0,rows=3)"]:
        out = torch.full_like(grad, 7.0)  # stale contents must not leak into the sum
        result = sc.parse_spec(text).transport.allreduce(grad, out=out)
        ok &= result is out and bool((out - reference).abs().max() <= 1e-5)
    in_place = grad.clone()
    ok &= sc.parse_spec("dense").transport.allreduce(in_place, out=in_place) is in_place
    return ok and torch.equal(in_place, reference)


def test_every_transport_can_write_the_sum_into_a_given_buffer():
    assert all(run_local(2, into_out))
    with pytest.raises(sc.SparseCommError, match="out has 3"):
        run_local_single_out_mismatch()


def run_local_single_out_mismatch():
    from sparsecomm.transport.base import output_buffer

    output_buffer(torch.zeros(3), 4, torch.float32)


def auto_collectives_per_call(rank: int, world: int) -> dict:
    from sparsecomm.transport import agreement, collectives

    calls = []
    gather, all_to_all, point_to_point = collectives.all_gather_single, dist.all_to_all_single, dist.batch_isend_irecv

    def counted(function):
        def call(*args, **kwargs):
            calls[-1] += 1
            return function(*args, **kwargs)
        return call

    collectives.all_gather_single = agreement.all_gather_single = counted(gather)
    dist.all_to_all_single, dist.batch_isend_irecv = counted(all_to_all), counted(point_to_point)
    session = sc.TransportSession(sc.CostModel())
    grad = contribution(rank, world, "random")
    reference = grad.clone()
    dist.all_reduce(reference)
    transport, chosen, exact = sc.parse_spec("auto(explore=0)").transport, [], True
    for _ in range(3):
        calls.append(0)
        reduction = transport.reduce(sc.SparseGradient.from_dense(grad), session=session)
        exact &= torch.equal(reduction.total, reference)
        chosen.append(reduction.record.transport)
    return {"calls": calls, "chosen": chosen, "exact": exact}


def test_auto_that_keeps_choosing_allgather_sends_sizes_on_its_agreement_step():
    # first call: agreement, size exchange, data; later calls: the agreement carries the sizes
    for result in run_local(2, auto_collectives_per_call):
        assert result["chosen"] == ["allgather"] * 3
        assert result["calls"] == [3, 2, 2]
        assert result["exact"]
