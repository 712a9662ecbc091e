"""`auto` and what it decides from: the α-β cost model's algorithm choices, the tuning of measured
trials (medians, near-ties, the model's ranking) and agreement on every rank."""

import pytest
import torch
import torch.distributed as dist

import sparsecomm as sc
from helpers import contribution, fed_and_conserved
from sparsecomm.launch import run_local
from sparsecomm.transport.cost_model import CostModel
from sparsecomm.transport.session import TransportSession


def test_cost_model_switches_algorithms_where_the_formulas_say():
    wire_only = CostModel(alpha=50e-6, beta=1 / 125e6, codec_per_nnz=0, pass_per_byte=0, sort_per_entry=0,
                             hash_per_entry=0, quantize_per_value=0,
                             dequantize_per_value=0)  # 1 Gbit/s, compute free: SparCML's formulas alone
    numel = 16_000_000
    assert wire_only.best_sparse_algorithm(8, numel, 1_000) == "ssar_rd"  # small result: latency decides
    assert wire_only.best_sparse_algorithm(8, numel, 1_000_000) in ("ssar_sa", "dsar_sa")  # result 40% dense
    assert wire_only.best_sparse_algorithm(8, numel, 1_000_000, qsgd_bits=4) == "dsar_sa"  # quantized dense phase
    assert wire_only.dense(4, numel) > 3 * wire_only.ssar_rd(4, numel, 160_000)  # 1% density: sparse wins big
    assert wire_only.expected_union(1000, 10, 2) == pytest.approx(1000 * (1 - 0.99**2))
    slow_codec = CostModel(alpha=50e-6, beta=1 / 125e6, quantize_per_value=100e-9, dequantize_per_value=100e-9)
    assert slow_codec.best_sparse_algorithm(8, numel, 1_000_000, qsgd_bits=4) != "dsar_sa"  # QSGD costs more


def test_a_peeled_sketch_grows_with_the_ranks_and_a_median_read_does_not():
    wire_only = CostModel(alpha=0, beta=1 / 125e6, pass_per_byte=0, hash_per_entry=0)
    numel, nnz = 1_000_000, 10_000
    median = [wire_only.sketch(workers, numel, nnz, 2.0, 32) for workers in (2, 16)]
    peel = [wire_only.sketch(workers, numel, nnz, 1.3, 32, rows=3, decode="peel") for workers in (2, 16)]
    assert median[1] < 2 * median[0]  # the bitmap and the cells stay; only the (P-1)/P factor moves
    assert peel[1] > 5 * peel[0]  # λ cells per marked entry of every rank: 8× the ranks
    # 10,000 entries at random mark about 8,560 of the 31,250 blocks of 32: 274k entries per rank to solve
    assert peel[0] > 30 * median[0]


def auto_choices(rank: int, world: int) -> list:
    grad = contribution(rank, world, "random", numel=50_000, nnz=500)
    transport = sc.parse_spec("auto(explore=2)").transport
    chosen = []
    with TransportSession() as session:
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
    # b's 9.0 was a spike (median 2.0 beats a's 3.0); c's one fast trial does not make it the fastest.
    # With three trials, b's spike overlaps a's: the two run on before b is chosen
    assert tuning.finalists == ["b", "a"]
    while (name := tuning.next_to_try(3)) is not None:
        tuning.record(name, {"a": 3.0, "b": 2.0}[name], 3)
    assert tuning.chosen == "b"


def test_tuning_runs_on_when_the_trials_overlap_though_the_medians_are_far_apart():
    """Five trials on a busy machine: b's median is 23% above a's, but b's faster trials are
    faster than a's slower ones, so five samples cannot order them; with more, a wins."""
    from sparsecomm.transport.tuning import Tuning

    tuning = Tuning(["a", "b"])
    for a, b in zip([9.8, 6.6, 9.5, 5.6, 10.0], [6.5, 7.7, 8.0, 10.0, 10.4], strict=True):
        tuning.record("a", a, 5)
        tuning.record("b", b, 5)
    assert tuning.chosen is None and tuning.finalists == ["b", "a"]
    while (name := tuning.next_to_try(5)) is not None:
        tuning.record(name, {"a": 6.0, "b": 8.0}[name], 5)
    assert tuning.chosen == "a"


def test_tuning_decides_at_once_where_the_trials_do_not_overlap():
    from sparsecomm.transport.tuning import Tuning

    tuning = Tuning(["a", "b", "c"])
    for a, b, c in zip([4.1, 5.6, 6.6, 6.9, 9.8], [6.5, 7.7, 10.0, 10.4, 13.2], [8.8, 9.1, 9.4, 9.4, 13.6],
                       strict=True):
        for name, seconds in (("a", a), ("b", b), ("c", c)):
            tuning.record(name, seconds, 5)
    assert tuning.chosen == "a" and tuning.finalists is None


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


def auto_collectives_per_call(rank: int, world: int) -> dict:
    from sparsecomm.transport import agreement, collectives

    calls = []
    gather, all_to_all, point_to_point = collectives.all_gather_single, dist.all_to_all_single, dist.batch_isend_irecv

    def counted(function):
        def call(*args, **kwargs):
            calls[-1] += 1
            return function(*args, **kwargs)
        return call

    def receiving_round(ops):  # a round's receives are posted in one batch (its sends may follow apart)
        if any(op.op is dist.irecv for op in ops):
            calls[-1] += 1
        return point_to_point(ops)

    collectives.all_gather_single = agreement.all_gather_single = counted(gather)
    dist.all_to_all_single, dist.batch_isend_irecv = counted(all_to_all), receiving_round
    session = TransportSession(CostModel())
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


def test_auto_that_keeps_choosing_allgather_runs_it_in_one_round():
    # first call: agreement, size exchange, data; then allgather's own round, the agreement records
    # in front of the payloads: the second call's first round is sized from nothing (records only,
    # payloads in a second round), the third's fits the payloads
    for result in run_local(2, auto_collectives_per_call):
        assert result["chosen"] == ["allgather"] * 3
        assert result["calls"] == [3, 2, 1]
        assert result["exact"]


def test_auto_weighs_the_global_top_k_only_where_the_callers_feedback_keeps_what_it_loses():
    """At 64 ranks of 1% of 25M entries the union of the selections is near half the tensor: a
    global top-k sends a selection's worth where exact sums send far more. It is a candidate only
    for a caller whose error feedback keeps what it drops."""
    from sparsecomm.transport.auto import GLOBAL_TOP_K, choose
    from sparsecomm.transport.request import Request

    model = CostModel(alpha=50e-6, beta=1 / 125e6)
    assert choose(model, 64, 25_000_000, 250_000, 4, Request(), global_top_k=True)[0] == GLOBAL_TOP_K
    exact, costs = choose(model, 64, 25_000_000, 250_000, 4, Request())
    assert exact != GLOBAL_TOP_K and GLOBAL_TOP_K not in costs
    assert choose(model, 8, 166_000, 166, 4, Request(), global_top_k=True)[0] == "allgather"  # few, small


def auto_under(rank: int, world: int, path: str) -> dict:
    import os

    from sparsecomm.transport.request import Request

    os.environ["SPARSECOMM_COST_MODEL"] = path
    grad = contribution(rank, world, "random", numel=20_000, nnz=400)
    transport = sc.parse_spec("auto(explore=0)").transport
    chosen = {}
    for keeps_lost in (False, True):
        with TransportSession() as session:
            reduction = transport.reduce(grad, request=Request(keeps_lost=keeps_lost), session=session)
        chosen[keeps_lost] = (reduction.record.transport, reduction.lost is not None)
    results = run_reducer(rank, world)
    return {"chosen": chosen, **results}


def run_reducer(rank: int, world: int) -> dict:
    reducer = sc.GradientReducer("topk(ratio=0.02)+residual+raw+fp32+auto(explore=0)")
    results = fed_and_conserved(reducer, rank, world, numel=20_000, steps=4)
    return {**results, "expected": set(reducer.runtime.session.expected.values())}


def test_auto_takes_the_global_top_k_for_a_pipeline_whose_feedback_keeps_the_rest(tmp_path):
    """Under a cost model of a slow wire and slow payload codecs, on three ranks, the global top-k
    (a selection's worth of bytes) is auto's first choice for a caller that keeps what is lost, and
    what its sum dropped is sent again later."""
    path = tmp_path / "model.json"
    CostModel(alpha=0.0, beta=1e-6, codec_per_nnz=1e-3, pass_per_byte=0.0, sort_per_entry=0.0).save(path)
    for result in run_local(3, auto_under, str(path)):
        assert result["chosen"][True] == ("sparse_allreduce(algorithm=topk_sa)", True)
        assert result["chosen"][False][0] != "sparse_allreduce(algorithm=topk_sa)"
        assert result["expected"] == {"sparse_allreduce(algorithm=topk_sa)"}
        torch.testing.assert_close(result["delivered_and_held"], result["fed"], rtol=0, atol=1e-4)


def one_rank_sends_a_bad_part(rank: int, world: int, case: str) -> str:
    """Rank 1's part holds a NaN, a repeated index or one out of range; ``auto`` without a session
    (the dense-or-sparse choice made after its agreement step)."""
    from sparsecomm.sparse_gradient import SparseGradient
    from sparsecomm.transport.request import Request

    indices, values = torch.tensor([rank, 10 + rank, 20]), torch.tensor([1.0, 2.0, 4.0])
    if rank == 1:
        if case == "nan":
            values = torch.tensor([1.0, float("nan"), 4.0])
        else:
            indices = torch.tensor([1, 1, 20]) if case == "repeat" else torch.tensor([1, 20, 100])
    transport = sc.parse_spec("auto(explore=0)").transport
    try:
        transport.reduce(SparseGradient(indices, values, torch.Size([100])), request=Request(key="w"))
    except sc.SparseCommError as err:
        return str(err)
    return "summed"


@pytest.mark.parametrize(("case", "says"), [("nan", "non-finite"), ("repeat", "repeats"), ("range", "outside")])
def test_a_part_the_chosen_transport_would_refuse_is_refused_on_every_rank(case, says):
    """Not summed without it on the others and with it on its own rank."""
    outcomes = run_local(3, one_rank_sends_a_bad_part, case, timeout=60)
    assert all(outcome != "summed" for outcome in outcomes), outcomes
    assert says in outcomes[1], outcomes
