"""Fused exchanges: several streams' payloads in one message behind one agreement record. Each sum is
the one its own call would give, bit for bit; ranks that fuse other streams fail together naming
them; a header that does not fit its message is refused before anything past it is read; and a DDP
step's small calls travel with its last one, training to the same bits as unfused calls."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from helpers import random_sparse
from sparsecomm.errors import PayloadError
from sparsecomm.launch import run_local
from sparsecomm.transport.allgather import FusedCall, fused_message, split_message
from sparsecomm.transport.request import Request
from sparsecomm.transport.session import TransportSession

STREAMS = {"a": (40_000, 300), "b": (5_000, 0), "c": (900, 900)}  # numel, nnz: a few, none, every entry
CODECS = {"a": ("rice", "int8"), "b": ("rice", "fp32"), "c": ("raw", "fp16")}


def calls(rank: int, call: int) -> list[FusedCall]:
    made = []
    for key, (numel, nnz) in STREAMS.items():
        index_codec, value_codec = sc.INDEX_CODECS.parse(CODECS[key][0]), sc.VALUE_CODECS.parse(CODECS[key][1])
        made.append(FusedCall(random_sparse(numel, nnz, seed=100 * call + 10 * rank + len(made)),
                              Request(key=key, call=call, index_codec=index_codec, value_codec=value_codec)))
    return made


def fused_and_alone(rank: int, world: int) -> list[bool]:
    """Per call and stream: whether the fused sum equals, bit for bit, the stream's own call's sum."""
    transport = sc.parse_spec("allgather").transport
    same = []
    with TransportSession() as fused_session, TransportSession() as alone_session:
        for call in range(3):  # the first call has no capacity yet: its payloads go in a second round
            fused = transport.reduce_fused(calls(rank, call), session=fused_session)
            for part, reduction in zip(calls(rank, call), fused, strict=True):
                alone = transport.reduce(part.grad, request=part.request, session=alone_session)
                same.append(torch.equal(reduction.total, alone.total) and reduction.record.bytes_sent > 0)
    return same


def test_a_fused_exchange_sums_each_stream_exactly_as_its_own_call():
    for same in run_local(2, fused_and_alone):
        assert len(same) == 3 * len(STREAMS) and all(same)


def fusing_other_streams(rank: int, world: int, what: str) -> str:
    transport = sc.parse_spec("allgather").transport
    with TransportSession() as session:
        for call in range(3):
            mine = calls(rank, call)
            if call == 2 and rank == 1:
                mine = mine[:2] if what == "fewer" else [mine[1], mine[0], mine[2]]
            try:
                transport.reduce_fused(mine, session=session)
            except sc.SparseCommError as err:
                return str(err)
    return "no error"


@pytest.mark.parametrize("what", ["fewer", "order"])
def test_ranks_that_fuse_other_streams_fail_together_naming_them(what):
    for message in run_local(2, fusing_other_streams, what):
        assert "different tensors" in message and "a (call 2)" in message


def test_a_fused_message_splits_back_into_its_payloads():
    payloads = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([9], dtype=torch.uint8)]
    parts = split_message(fused_message(payloads), [10, 10])
    assert [part.tolist() for part in parts] == [[1, 2, 3], [9]]


@pytest.mark.parametrize("damage", ["truncated header", "count", "a size too large", "sizes past the end",
                                    "a zero size", "bytes left over"])
def test_a_fused_header_that_does_not_fit_its_message_is_refused(damage):
    message = fused_message([torch.arange(5, dtype=torch.uint8), torch.arange(7, dtype=torch.uint8)])
    header = np.frombuffer(message[:24].numpy().tobytes(), dtype="<i8").copy()
    body = message[24:]
    if damage == "truncated header":
        message = message[:20]
    else:
        if damage == "count":
            header[0] = 3
        elif damage == "a size too large":
            header[1] = 1 << 62  # no codec makes this for 10 elements; nothing is allocated for it
        elif damage == "sizes past the end":
            header[2] = 8
        elif damage == "a zero size":
            header[1], header[2] = 0, 12
        message = torch.cat([torch.from_numpy(header.view(np.uint8)), body])
        if damage == "bytes left over":
            message = torch.cat([message, torch.zeros(1, dtype=torch.uint8)])
    with pytest.raises(PayloadError):
        split_message(message, [10, 10])


class ThreeBuckets(nn.Module):
    """Small layers in buckets of their own (DDP's ``bucket_cap_mb``), and a sparse embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(300, 16, sparse=True)
        self.hidden = nn.Linear(16 * 4, 256)
        self.output = nn.Linear(256, 300)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(torch.relu(self.hidden(self.embedding(tokens).flatten(1))))


class ThreeBucketTraining:
    """`ThreeBuckets` under DDP in small buckets with ``spec``'s hook and plain SGD, the same weights
    on every rank; `step` trains on a batch of this rank's tokens."""

    def __init__(self, rank: int, spec: str) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.model = ThreeBuckets()
        self.net = DDP(self.model, bucket_cap_mb=0.05)
        self.reducer = sc.register_ddp_hook(self.net, spec)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.generator = torch.Generator().manual_seed(rank)

    def step(self) -> None:
        tokens = torch.randint(300, (32, 5), generator=self.generator)
        self.optimizer.zero_grad()
        nn.functional.cross_entropy(self.net(tokens[:, :4]), tokens[:, 4]).backward()
        self.optimizer.step()


def recording_fused_exchanges(fuse_below: int) -> list[list[str]]:
    """In this worker process only: ``FUSE_BELOW`` set to ``fuse_below``, and a list that gets the
    streams (sorted) of each exchange that carries several calls."""
    import sparsecomm.reducer.paths.base as reducer_module
    from sparsecomm.transport.allgather import AllgatherTransport

    reducer_module.FUSE_BELOW = fuse_below
    fused: list[list[str]] = []
    original = AllgatherTransport.reduce_fused

    def recorded(self, calls, *args, **kwargs):
        if len(calls) > 1:
            fused.append(sorted(call.request.key for call in calls))
        return original(self, calls, *args, **kwargs)

    AllgatherTransport.reduce_fused = recorded
    return fused


def train_three_buckets(rank: int, world: int, spec: str, fuse_below: int) -> tuple[str, list[list[str]]]:
    """(the weights after six steps, the streams of each exchange that carried several calls)."""
    fused = recording_fused_exchanges(fuse_below)
    training = ThreeBucketTraining(rank, spec)
    for _ in range(6):
        training.step()
    training.reducer.close()
    digest = torch.cat([p.detach().reshape(-1) for p in training.model.parameters()]).numpy().tobytes()
    return digest.hex(), fused


@pytest.mark.parametrize("spec", ["dgc", "adaptive(budget=3000)+dgc_momentum(masking=false,nesterov=true)+rice+int8"
                                  "+allgather"])
def test_a_ddp_steps_small_calls_travel_with_its_last_and_train_to_the_same_bits(spec):
    unfused = run_local(2, train_three_buckets, spec, 0)
    fused = run_local(2, train_three_buckets, spec, 1 << 14)
    assert unfused[0][0] == unfused[1][0] == fused[0][0] == fused[1][0]
    assert unfused[0][1] == []  # every call alone
    assert max(len(keys) for keys in fused[0][1]) >= 3  # the small buckets with the last, the embedding's rows


def embedding_rows_of(rank: int, step: int) -> torch.Tensor:
    """20 of 300 rows of width 16, different per rank and step."""
    generator = torch.Generator().manual_seed(10 * step + rank)
    rows = torch.randperm(300, generator=generator)[:20].sort().values
    return torch.sparse_coo_tensor(rows[None], torch.randn(20, 16, generator=generator), (300, 16),
                                   check_invariants=True)


def rows_before_a_weight(rank: int, world: int, fuse_below: int) -> tuple[list[torch.Tensor], list[list[str]]]:
    """Three steps of a custom loop whose embedding rows come before its last call, a weight too large
    to wait with ``fuse_below`` 1 (82 entries; fp32 values and no momentum: the rows' average is
    exactly the two ranks' rows): each step's rows' average, and the streams of each exchange that
    carried several calls."""
    fused = recording_fused_exchanges(fuse_below)
    averages, reducer = [], None
    for step in range(3):
        embedding, weight = embedding_rows_of(rank, step), torch.randn(8192)
        reducer = sc.allreduce_gradients([("embedding", embedding), ("weight", weight)],
                                         "topk(ratio=0.01)+residual+rice+fp32+allgather", reducer)
        averages.append(embedding.to_dense())
    assert reducer is not None
    reducer.close()
    return averages, fused


def test_an_embeddings_rows_travel_with_the_steps_last_call_whatever_their_size_and_arrive_exact():
    alone, together = run_local(2, rows_before_a_weight, 0), run_local(2, rows_before_a_weight, 1)
    assert alone[0][1] == [] and together[0][1] == [["embedding", "weight"]] * 3
    for step in range(3):
        exact = (embedding_rows_of(0, step).to_dense() + embedding_rows_of(1, step).to_dense()) / 2
        for averages, _ in (*alone, *together):
            assert torch.equal(averages[step], exact)


def poisoned_in_a_fused_bucket(rank: int, world: int, spec: str, poison_value: float) -> str:
    training = ThreeBucketTraining(rank, spec)
    poison = {"now": False}

    def maybe_poison(grad: torch.Tensor) -> torch.Tensor:
        if poison["now"]:
            grad = grad.clone()
            grad.view(-1)[7] = poison_value
        return grad

    training.model.hidden.weight.register_hook(maybe_poison)
    try:
        for step in range(4):
            poison["now"] = rank == 1 and step == 2  # one rank, one entry of a bucket that travels fused
            training.step()
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        return f"step {step}: {type(err).__name__}: {err}"
    finally:
        training.reducer.close()
    return "no error"


def test_a_non_finite_gradient_in_a_fused_call_makes_every_rank_raise_at_that_step():
    for outcome in run_local(2, poisoned_in_a_fused_bucket, "dgc", float("nan")):
        assert outcome.startswith("step 2:") and "non-finite" in outcome


def test_a_value_one_ranks_codec_refuses_in_a_fused_call_makes_every_rank_raise_at_that_step():
    """fp16 cannot carry 1e6: that rank's codec refuses it, and every rank raises at that step."""
    outcomes = run_local(2, poisoned_in_a_fused_bucket, "topk(ratio=0.01)+residual+rice+fp16+allgather", 1e6,
                         timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith("step 2:") and "could not make its part of" in outcome
        assert ("overflows fp16" in outcome) == (rank == 1)
