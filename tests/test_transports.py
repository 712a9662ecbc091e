"""Transports on real multi-process gloo groups (started by the tests): lossless transports equal a
dense all_reduce of the same inputs, every rank gets the same bits, empty selections never hang,
mismatched ranks fail clearly, and the sketch transport is unbiased."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

import sparsecomm as sc
from helpers import contribution
from sparsecomm.launch import run_local
from sparsecomm.transport.request import Request
from sparsecomm.transport.session import TransportSession

EXACT = ["allgather", "dense", "auto", "auto(explore=0)", "sparse_allreduce(algorithm=ssar_rd)",
         "sparse_allreduce(algorithm=ssar_sa)", "sparse_allreduce(algorithm=dsar_sa)", "sparse_allreduce"]
OVERLAPS = ["random", "none", "full", "rank0_empty", "all_empty", "dense_result"]


def exact_scenarios(rank: int, world: int) -> dict:
    errors, digests = {}, {}
    session = TransportSession()
    for overlap in OVERLAPS:
        grad = contribution(rank, world, overlap)
        reference = grad.clone()
        dist.all_reduce(reference)
        for text in EXACT:
            transport = sc.parse_spec(text).transport
            request = Request(index_codec=sc.INDEX_CODECS.create("rice"))
            result = transport.allreduce(sc.SparseGradient.from_dense(grad), request=request, session=session)
            asynchronous = transport.reduce_async(sc.SparseGradient.from_dense(grad), session=session).wait().total
            errors[(overlap, text)] = float((result - reference).abs().max())
            # exploring, or (with a session on gloo) choosing from the call before's agreement records
            # when that call ran allgather: consecutive calls may sum in another order
            if text.startswith("auto"):
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
        result = transport.allreduce(grad, request=Request(seed=1))
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
    outputs = torch.stack([transport.allreduce(grad, request=Request(step=t)) for t in range(trials)])
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


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1000])
def test_the_sketch_bitmap_packs_bits_as_numpy_does_with_tensor_ops(count):
    from sparsecomm.transport.sketch_allreduce import pack_bits, unpack_bits

    marks = torch.rand(count, generator=torch.Generator().manual_seed(count)) < 0.3
    packed = pack_bits(marks)
    assert packed.numpy().tobytes() == np.packbits(marks.numpy()).tobytes()
    assert torch.equal(unpack_bits(packed, count), marks)


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

    output_buffer(torch.zeros(3), 4, torch.float32, torch.device("cpu"))


def allgather_with_codecs(rank: int, world: int, dtype: torch.dtype, value_codec: str) -> dict:
    grad = sc.SparseGradient(torch.tensor([rank, 7, 100 + rank]),
                             torch.tensor([1 / 3, 2 / 3 + rank, -1 / 7], dtype=dtype), torch.Size([200]))
    request = Request(value_codec=sc.VALUE_CODECS.create(value_codec))
    result = sc.parse_spec("allgather").transport.allreduce(grad, request=request)
    # what every rank must get: each rank's values as the codec sends them, summed in rank order
    expected = torch.zeros(200, dtype=dtype)
    for other in range(world):
        values = torch.tensor([1 / 3, 2 / 3 + other, -1 / 7], dtype=dtype)
        sent = sc.decode(sc.encode(sc.SparseGradient(torch.tensor([other, 7, 100 + other]), values,
                                                     torch.Size([200])), "rice", value_codec))
        expected.index_add_(0, sent.indices, sent.values)
    return {"equal": torch.equal(result, expected), "digest": result.numpy().tobytes()}


@pytest.mark.parametrize(("dtype", "value_codec"), [(torch.float64, "fp32"), (torch.float32, "fp16"),
                                                     (torch.float16, "fp32"), (torch.float32, "fp32")])
def test_allgather_sums_what_the_codecs_send_including_this_ranks_own_values(dtype, value_codec):
    # a rank skips decoding its own payload only when the codecs carry its values exactly
    results = run_local(3, allgather_with_codecs, dtype, value_codec)
    assert all(r["equal"] for r in results)
    assert len({r["digest"] for r in results}) == 1


def skewed(rank: int, numel: int, nnz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's gradient, ``nnz`` entries all in the first fifth of ``numel``, and the ranks' sum."""
    generator = torch.Generator().manual_seed(rank)
    grad = torch.zeros(numel)
    grad[torch.randperm(numel // 5, generator=generator)[:nnz]] = torch.randn(nnz, generator=generator)
    total = grad.clone()
    dist.all_reduce(total)
    return grad, total


def skewed_split_allgather(rank: int, world: int, tamper: bool) -> dict:
    numel = 100_000
    grad, reference = skewed(rank, numel, 1_000)
    transport = sc.parse_spec("sparse_allreduce(algorithm=ssar_sa)").transport
    session = TransportSession()
    errors, results = [], []
    for call in range(3):
        if tamper and call == 2 and rank == 1:  # this rank's session splits elsewhere
            bounds = list(session.split_points[("w", numel, world)])
            bounds[1] += 1
            session.split_points[("w", numel, world)] = tuple(bounds)
        try:
            result = transport.allreduce(sc.SparseGradient.from_dense(grad), request=Request(key="w", call=call),
                                         session=session)
        except sc.SparseCommError as err:
            errors.append(str(err))
            break
        results.append(result)
        errors.append(float((result - reference).abs().max()))
    bounds = session.split_points[("w", numel, world)]
    union = torch.nonzero(reference).squeeze(1)
    per_range = [int(((union >= lo) & (union < hi)).sum()) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    return {"errors": errors, "bounds": bounds, "per_range": per_range,
            "digest": b"".join(r.numpy().tobytes() for r in results)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_split_allgather_balances_its_ranges_by_nonzeros(world):
    # every rank's nonzeros lie in the first fifth of the tensor: equal ranges would give rank 0 all
    # of them; after one call, the ranges split the result's nonzeros into near-equal shares
    results = run_local(world, skewed_split_allgather, False)
    first = results[0]
    assert all(r["bounds"] == first["bounds"] and r["digest"] == first["digest"] for r in results)
    assert all(error <= 1e-5 for r in results for error in r["errors"])
    assert first["bounds"][1] < 100_000 // 5  # the first range no longer holds every nonzero
    assert max(first["per_range"]) <= 1.25 * min(first["per_range"]), first["per_range"]


def skewed_global_top_k(rank: int, world: int) -> dict:
    numel = 100_000
    grad, total = skewed(rank, numel, 1_000)
    union = torch.nonzero(total).squeeze(1)
    transport = sc.parse_spec("sparse_allreduce(algorithm=topk_sa)").transport
    session, bounds, kept = TransportSession(), [], []
    for call in range(3):
        reduction = transport.reduce(sc.SparseGradient.from_dense(grad), request=Request(key="w", call=call),
                                     session=session)
        bounds.append(session.split_points[("w", numel, world)])
        kept.append(int(torch.count_nonzero(reduction.total)))
    per_range = [int(((union >= lo) & (union < hi)).sum()) for lo, hi in zip(bounds[-1][:-1], bounds[-1][1:],
                                                                              strict=True)]
    return {"bounds": bounds, "per_range": per_range, "kept": kept,
            "digest": reduction.total.numpy().tobytes()}


@pytest.mark.parametrize("world", [2, 4])
def test_a_global_top_k_balances_its_ranges_by_the_sums_before_the_cut(world):
    # topk_sa's owners each keep ⌈k/P⌉ entries, so its result cannot show where the selections lie;
    # the counts each owner appends before its cut can: every nonzero here lies in the first fifth,
    # and each call's ranges split the sums of the call before more finely, into near-equal shares
    results = run_local(world, skewed_global_top_k)
    first = results[0]
    assert all(r["bounds"] == first["bounds"] and r["digest"] == first["digest"] for r in results)
    assert first["bounds"][0][-2] < 100_000 // 5  # every range but the last within the first fifth
    assert max(first["per_range"]) <= 1.25 * min(first["per_range"]), first["per_range"]
    # on equal ranges the first owner holds every sum and keeps its ⌈k/P⌉ of them, the others none:
    # the result holds 1/P of a selection; on balanced ranges each owner keeps its ⌈k/P⌉, k in all
    assert first["kept"][0] <= 1_000 // world + 1
    assert 0.95 * 1_000 <= first["kept"][1] <= 1_000 + world


def test_an_owners_counts_are_checked_before_they_split_anything():
    from sparsecomm.transport.owner_counts import OWNER_BINS, owner_counts, owner_edges, without_counts
    from sparsecomm.transport.sparse_allreduce import balanced_bounds
    from sparsecomm.transport.streams import Stream

    counts = torch.zeros(OWNER_BINS, dtype=torch.int64)
    with pytest.raises(sc.PayloadError, match="cannot end in"):
        without_counts(torch.zeros(3, dtype=torch.uint8), counts)
    tail = torch.tensor([5, -1] + [0] * (OWNER_BINS - 2), dtype=torch.int32).view(torch.uint8)
    body = without_counts(torch.cat([torch.ones(2, dtype=torch.uint8), tail]), counts)
    assert body.tolist() == [1, 1] and counts[:2].tolist() == [5, -1]
    with pytest.raises(sc.PayloadError, match="cannot split"):
        balanced_bounds(counts, 100, 2)
    with pytest.raises(sc.PayloadError, match="cannot split"):
        balanced_bounds(torch.tensor([60, 60]), 100, 2)
    assert balanced_bounds(torch.tensor([0, 0, 10, 10]), 100, 2) == (0, 75, 100)
    # an owner's parts hold exactly the entries between the edges every rank derives from the bounds
    bounds = (0, 7, 7, 1000)
    edges = owner_edges(bounds)
    assert edges.numel() == 3 * OWNER_BINS + 1 and edges.diff().min() >= 0
    for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        every = Stream.sparse(torch.arange(hi - lo), torch.ones(hi - lo), hi - lo, lo)
        part = edges[r * OWNER_BINS:(r + 1) * OWNER_BINS + 1]
        assert owner_counts(every).tolist() == part.diff().tolist()


def test_ranks_that_split_differently_fail_clearly():
    results = run_local(3, skewed_split_allgather, True)
    for r in results:
        assert isinstance(r["errors"][-1], str) and "disagree" in r["errors"][-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_rank_order_sum_gives_the_same_bits_in_any_arrival_order(dtype, world):
    """Ranks 0 and 1 may be added in either order (rank 1 adds its own while rank 0's travels);
    the bits must not depend on arrival, signed zeros and values of very different size included."""
    import itertools

    from sparsecomm.transport.allgather import RankOrderSum

    numel, generator = 64, torch.Generator().manual_seed(world)
    parts = []
    for _rank in range(world):
        indices = torch.randperm(numel, generator=generator)[:40]
        values = torch.randn(40, generator=generator) * 10.0 ** torch.randint(-6, 6, (40,), generator=generator)
        values[:4] = torch.tensor([0.0, -0.0, -0.0, 0.0])
        parts.append(sc.SparseGradient(indices, values.to(dtype), (numel,)))
    sums = []
    for order in itertools.permutations(range(world)):
        summing = RankOrderSum(torch.zeros(numel, dtype=dtype))
        for rank in order:
            summing.add(rank, parts[rank])
        sums.append(summing.total.view(torch.int16 if dtype == torch.float16 else torch.int32))
    assert all(torch.equal(s, sums[0]) for s in sums)
    assert torch.allclose(sums[0].view(dtype).float(), sum(p.to_dense().float() for p in parts), rtol=1e-2, atol=1e-3)


def receive_buffers_across_calls(rank: int, world: int) -> dict:
    from sparsecomm.transport.payload_exchange import ENVELOPE_BYTES

    session, peer, cpu = TransportSession(), 1 - rank, torch.device("cpu")
    addresses, errors, landed = {}, [], []
    for call in range(4):  # other values each call: a stale buffer must not leak into the sum
        grad = contribution(rank, world, "random") * (call + 1)
        reference = grad.clone()
        dist.all_reduce(reference)
        for text, purpose, start, mark in (
            ("allgather", "payloads, first round", ENVELOPE_BYTES, b"SPCM"),
            ("sparse_allreduce(algorithm=dsar_sa)", "split-allgather, allgather", 0, b"\x01"),
        ):  # a dense stream's first byte
            result = sc.parse_spec(text).transport.allreduce(sc.SparseGradient.from_dense(grad), session=session)
            errors.append(float((result - reference).abs().max()))
            buffer = session.receive_buffer(purpose, peer, start + len(mark), cpu)
            addresses.setdefault(text, []).append(buffer.data_ptr())
            landed.append(bytes(buffer[start:].numpy()) == mark)  # the peer's message is what it holds
    session.close()
    return {"errors": errors, "addresses": addresses, "landed": landed}


def test_a_session_receives_into_the_same_buffers_call_after_call():
    for result in run_local(2, receive_buffers_across_calls):
        assert max(result["errors"]) <= 1e-5
        # the payload allgather's first call sizes its buffers from nothing (its payloads come in a
        # second round), and grows them once
        assert all(result["landed"][1:])
        assert all(len(set(addresses[1:])) == 1 for addresses in result["addresses"].values()), result["addresses"]


def test_a_session_buffer_grows_when_a_larger_message_comes():
    session, cpu = TransportSession(), torch.device("cpu")
    small = session.receive_buffer("payloads", 1, 100, cpu)
    assert small.numel() == 100 and session.receive_buffer("payloads", 1, 60, cpu).data_ptr() == small.data_ptr()
    large = session.receive_buffer("payloads", 1, 1000, cpu)
    assert large.numel() == 1000
    assert session.receive_buffer("payloads", 2, 100, cpu).data_ptr() != large.data_ptr()  # another peer
