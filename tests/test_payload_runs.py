"""Runs of consecutive indices in a payload: a tensor sent whole costs a (start, length) pair, not an
index code per entry, decodes to the same entries, and a hostile runs block is refused."""

import struct

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.encode.runs import MIN_RUN
from sparsecomm.fuzz import PayloadParts
from sparsecomm.payload import FLAG_RUNS, FORMAT_VERSION, MAGIC
from test_decode_bounds import bound, decode_measured

NUMEL = 50_000
LOSSLESS = ["raw", "raw(bits=64)", "packed", "rle", "delta_binary", "huffman", "rice", "rice(parameter=0)", "bitmap"]


def with_a_bias(numel: int = NUMEL, run: range = range(40_000, 45_001), scattered: int = 50,
                seed: int = 0) -> sc.SparseGradient:
    """A few scattered entries and one long run, as a bucket whose bias goes whole."""
    rng = np.random.default_rng(seed)
    indices = np.union1d(rng.choice(numel, size=scattered, replace=False), np.arange(run.start, run.stop))
    values = torch.from_numpy(rng.standard_normal(indices.size).astype(np.float32))
    return sc.SparseGradient(torch.from_numpy(indices), values, torch.Size([numel]))


@pytest.mark.parametrize("index_codec", LOSSLESS)
def test_a_long_run_costs_one_pair_and_decodes_to_the_same_entries(index_codec):
    grad = with_a_bias()
    payload = sc.encode(grad, index_codec, "fp32")
    info = sc.read_info(payload)
    coded_alone = len(sc.INDEX_CODECS.parse(index_codec).encode(grad.indices.numpy(), NUMEL))
    assert info.flags & FLAG_RUNS and info.index_bytes < coded_alone
    decoded = sc.decode(payload, expect=(NUMEL,))
    assert torch.equal(decoded.indices, grad.indices) and torch.equal(decoded.values, grad.values)


def test_runs_save_an_index_codes_worth_of_bytes_on_dgcs_run_lengths():
    grad = with_a_bias()
    info = sc.read_info(sc.encode(grad, "rle", "fp32"))
    assert info.index_bytes < 2 * 60 + 4 + 2 * 16  # the scattered entries' words, the block, at most two runs


@pytest.mark.parametrize("run", [range(0, 300), range(NUMEL - 300, NUMEL), range(0, NUMEL)])
def test_runs_at_the_tensors_edges_and_over_all_of_it(run):
    grad = with_a_bias(run=run, scattered=0 if len(run) == NUMEL else 30)
    payload = sc.encode(grad, "rice", "fp16")
    assert sc.read_info(payload).flags & FLAG_RUNS
    assert torch.equal(sc.decode(payload).indices, grad.indices)


def test_a_run_shorter_than_the_minimum_stays_with_the_codec():
    grad = with_a_bias(run=range(1_000, 1_000 + MIN_RUN - 1))
    assert not sc.read_info(sc.encode(grad, "rle", "fp32")).flags & FLAG_RUNS


def test_the_codec_codes_the_rest_as_if_the_runs_were_cut_out():
    # rice(parameter=0) codes a gap of g in g + 1 bits: the first index costs 9,937 bits either way,
    # the one after the run 128 bits cut out, 30,128 bits (3.8 kB) in the tensor's own positions
    run = range(10_000, 40_000)
    grad = with_a_bias(run=run, scattered=0)
    grad = sc.SparseGradient(torch.cat([torch.tensor([9_999 - 63]), grad.indices, torch.tensor([40_063])]),
                             torch.ones(len(run) + 2), torch.Size([NUMEL]))
    info = sc.read_info(sc.encode(grad, "rice(parameter=0)", "fp32"))
    assert info.flags & FLAG_RUNS and info.index_bytes < 20 + (9_937 + 128) // 8 + 8


@pytest.mark.parametrize("index_codec", ["bloom(policy=p0)", "skcompress"])
def test_lossy_and_joint_index_codecs_keep_every_index_to_themselves(index_codec):
    payload = sc.encode(with_a_bias(), index_codec, "fp32")
    assert not sc.read_info(payload).flags & FLAG_RUNS


def test_a_payload_with_runs_keeps_its_bytes():
    # frozen: 10..79 as a run; 150 and 199 by run lengths in the 130 positions outside it (80 zeros
    # before the first, 48 between)
    indices = torch.tensor([*range(10, 80), 150, 199])
    grad = sc.SparseGradient(indices, torch.arange(72, dtype=torch.float32) / 8, torch.Size([200]))
    payload = sc.encode(grad, "rle", "fp32")
    parts = PayloadParts.parse(payload)
    assert parts.fields["flags"] == FLAG_RUNS and parts.fields["version"] == FORMAT_VERSION
    assert parts.index_section.hex() == "01000000" + "0a00000000000000" + "4600000000000000" + "50003000"
    assert torch.equal(sc.decode(payload).values, grad.values)


def runs_payload(block: bytes, stream: bytes = b"", nnz: int = 100, numel: int = 1_000,
                 index_text: str = "raw", flags: int = FLAG_RUNS) -> bytes:
    fields = {"magic": MAGIC, "version": FORMAT_VERSION, "flags": flags, "dtype": 1, "ndim": 1, "numel": numel,
              "nnz": nnz}
    return PayloadParts(fields, struct.pack("<Q", numel), index_text, "fp32", block + stream,
                        b"\0" * 4 * nnz).assemble()


def pairs(*runs: tuple[int, int], count: int | None = None) -> bytes:
    return struct.pack("<I", len(runs) if count is None else count) + b"".join(struct.pack("<QQ", *r) for r in runs)


@pytest.mark.parametrize(("payload", "message"), [
    (runs_payload(b"\1\0"), "too short for its runs block"),
    (runs_payload(pairs(count=0)), "does not fit"),
    (runs_payload(pairs((0, 100), count=2)), "does not fit"),
    (runs_payload(pairs((0, 0), (10, 100))), "empty or reaches outside"),
    (runs_payload(pairs((950, 100))), "empty or reaches outside"),
    (runs_payload(pairs((1_000, 1))), "empty or reaches outside"),
    (runs_payload(pairs((2**64 - 1, 2**64 - 1))), "empty or reaches outside"),
    (runs_payload(pairs((500, 50), (0, 50))), "out of order or touch"),
    (runs_payload(pairs((0, 50), (50, 50))), "out of order or touch"),
    (runs_payload(pairs((0, 101))), "runs hold 101 indices, the payload 100"),
    (runs_payload(pairs((0, 99)), struct.pack("<I", 901)), "not strictly increasing"),  # outside: 0..900
    (runs_payload(pairs((0, 99)), struct.pack("<II", 500, 600)), "8 bytes for 1 indices"),  # the rest, by the codec
    (runs_payload(pairs((0, 100)), index_text="bloom(policy=p0)"), "lossy indices or the values too"),
    (runs_payload(pairs((0, 100)), flags=FLAG_RUNS | 1), "lossy indices or the values too"),
])
def test_a_hostile_runs_block_is_refused_saying_why(payload, message):
    with pytest.raises(sc.PayloadError, match=message):
        sc.decode(payload, expect=1_000)


def test_runs_that_claim_the_whole_tensor_stay_within_the_decode_bound():
    numel = 1 << 40  # a run over all of it: refused by nnz before it is expanded
    payload = runs_payload(pairs((0, numel)), nnz=100, numel=numel)
    outcome, peak, _ = decode_measured(payload, expect=numel)
    assert isinstance(outcome, sc.PayloadError) and peak <= bound(payload)


@pytest.mark.parametrize("numel", [1 << 23, 1 << 40])
def test_a_run_over_a_huge_tensor_is_not_expanded_before_its_values_decode(numel):
    # one 20-byte block claims every index: refused by the values, junk or too few, unexpanded
    fields = {"magic": MAGIC, "version": FORMAT_VERSION, "flags": FLAG_RUNS, "dtype": 1, "ndim": 1,
              "numel": numel, "nnz": numel}
    payload = PayloadParts(fields, struct.pack("<Q", numel), "raw", "zstd", pairs((0, numel)),
                           bytes(128)).assemble()
    outcome, peak, _ = decode_measured(payload)
    assert isinstance(outcome, sc.PayloadError) and peak < 1 << 20, (outcome, peak)


def dgc_bytes_of_an_output_layer(rank: int, world: int) -> tuple[float, int]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(256, 5_001))  # one bucket: the weight sparsified, the bias whole
    reducer = sc.register_ddp_hook(model, "dgc")
    data = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))
    for _ in range(4):
        model.zero_grad()
        model(data).logsumexp(1).mean().backward()
    reducer.close()
    return reducer.stats.bytes_per_step, model.module.weight.numel()


def test_dgcs_bias_in_a_ddp_bucket_costs_its_values_and_no_indices():
    from sparsecomm.launch import run_local

    for sent, weights in run_local(2, dgc_bytes_of_an_output_layer):
        selected = weights // 1000  # 0.1% of the weight, with 2-byte run lengths
        assert sent < 4 * 5_001 + 1.2 * 6 * selected + 200, sent  # the bias's 20 kB, no 10 kB of indices
