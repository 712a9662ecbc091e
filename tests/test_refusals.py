"""A codec that cannot carry one rank's values (a value beyond fp16's range; a float64 value beyond
the float32 a codec sends) refuses them on that rank alone. Every rank must then raise at that
call, the refusing rank with its codec's reason, and none may be left waiting for a payload that
never comes."""

import pytest
import torch

import sparsecomm as sc
from helpers import adaptive_at_once, random_sparse
from sparsecomm.launch import run_local
from sparsecomm.transport.allgather import FusedCall
from sparsecomm.transport.request import Request
from sparsecomm.transport.session import TransportSession

HANG_S = 60  # a rank left waiting fails the test here instead of hanging it


def gradient(rank: int, dtype: torch.dtype, huge: float) -> torch.Tensor:
    grad = torch.randn(10_000, generator=torch.Generator().manual_seed(rank), dtype=dtype)
    if rank == 0:
        grad[5] = huge  # only rank 0's codec refuses
    return grad


def embedding_rows(rank: int, dtype: torch.dtype, huge: float) -> torch.Tensor:
    """20 rows of an embedding's gradient, as ``gradient``: rank 0's holds ``huge``."""
    rows = gradient(rank, dtype, huge)[:320].view(20, 16)
    at = torch.randperm(300, generator=torch.Generator().manual_seed(rank))[:20].sort().values
    return torch.sparse_coo_tensor(at[None], rows, (300, 16), check_invariants=True)


def reduce_with(rank: int, world: int, spec: str, dtype: torch.dtype, huge: float, rows: bool = False) -> str:
    reducer = sc.GradientReducer(spec, seed=0)
    try:
        reducer.allreduce_([("w", embedding_rows(rank, dtype, huge) if rows else gradient(rank, dtype, huge))])
    except sc.SparseCommError as err:
        return str(err)
    finally:
        reducer.close()
    return "no error"


@pytest.mark.parametrize(("spec", "dtype", "huge", "reason"), [
    ("topk(ratio=0.1)+residual+rice+fp16+allgather", torch.float32, 1e6, "overflows fp16"),
    (adaptive_at_once(), torch.float64, 1e300, "overflows int8"),
    ("topk(ratio=0.1)+residual+raw+fp32+auto", torch.float64, 1e300, "overflows fp32"),
], ids=["pipeline payload", "adaptive", "auto"])
def test_one_ranks_refusing_codec_makes_every_rank_raise_at_that_call(spec, dtype, huge, reason):
    refusing, other = run_local(2, reduce_with, spec, dtype, huge, timeout=HANG_S)
    assert "could not make its part of 'w'" in refusing and reason in refusing
    assert "could not make its part of 'w'" in other and reason not in other


def direct_calls(rank: int, world: int, fused: bool) -> str:
    """The allgather transport called directly (it encodes): one call, or three fused."""
    transport = sc.parse_spec("allgather").transport
    codecs = {"index_codec": sc.INDEX_CODECS.parse("rice"), "value_codec": sc.VALUE_CODECS.parse("fp16")}
    refused = random_sparse(5000, 50, seed=rank)
    if rank == 0:
        refused.values[3] = 1e6
    parts = [FusedCall(random_sparse(5000, 50, seed=10 + rank), Request(key="a", **codecs)),
             FusedCall(refused, Request(key="b", **codecs)),
             FusedCall(random_sparse(900, 900, seed=20 + rank), Request(key="c", **codecs))]
    with TransportSession() as session:
        try:
            if fused:
                transport.reduce_fused(parts, session=session)
            else:
                transport.reduce(parts[1].grad, request=parts[1].request, session=session)
        except sc.SparseCommError as err:
            return str(err)
    return "no error"


def test_embedding_rows_beyond_the_pipelines_rounding_make_every_rank_raise_at_that_call():
    """Rows go in the pipeline's value format where it is a rounding (here fp16), its error held."""
    refusing, other = run_local(2, reduce_with, "topk(ratio=0.1)+residual+rice+fp16+allgather", torch.float32, 1e6,
                                True, timeout=HANG_S)
    assert "could not make its part of 'w'" in refusing and "overflows fp16" in refusing
    assert "could not make its part of 'w'" in other and "overflows fp16" not in other


@pytest.mark.parametrize("fused", [False, True], ids=["one call", "fused calls"])
def test_a_transport_that_encodes_itself_makes_every_rank_raise_on_a_refusal(fused):
    refusing, other = run_local(2, direct_calls, fused, timeout=HANG_S)
    assert "could not make its part of" in refusing and "overflows fp16" in refusing
    assert "could not make its part of" in other
