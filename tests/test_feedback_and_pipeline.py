"""Error feedback keeps every unsent unit of gradient, and a pipeline is deterministic per seed."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsecomm as sc


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    steps=st.integers(1, 30),
    sparsifier=st.sampled_from(["topk(ratio=0.05)", "randomk(k=3)", "dgc(ratio=0.1)", "bucketed_topk(k=1,bucket=16)",
                                "block_topk(k=1,block=8)", "threshold(value=40.0)"]),
    index_codec=st.sampled_from(["rice", "bitmap", "raw"]),
)
def test_sent_plus_residual_equals_the_accumulated_input_exactly(seed, steps, sparsifier, index_codec):
    """Integer-valued gradients make float32 sums exact, so equality is exact, not approximate."""
    pipe = sc.Pipeline(f"{sparsifier}+residual+{index_codec}+fp32", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    total_in = torch.zeros(6, 16)
    total_sent = torch.zeros(6, 16)
    for _ in range(steps):
        grad = torch.randint(-50, 51, (6, 16), generator=generator).float()
        total_in += grad
        total_sent += sc.decode(pipe.compress(grad, key="w")).to_dense()
    residual = pipe.states["w"].feedback["residual"]
    assert torch.equal(total_sent + residual, total_in)


def test_lossy_values_leave_their_quantization_error_in_the_residual():
    """float64 keeps the bookkeeping exact enough to see any value that went missing."""
    pipe = sc.Pipeline("topk(ratio=0.1)+residual+raw+qsgd(bits=4,bucket=8)")
    generator = torch.Generator().manual_seed(0)
    total_in = torch.zeros(200, dtype=torch.float64)
    total_sent = torch.zeros(200, dtype=torch.float64)
    for _ in range(50):
        grad = torch.randn(200, generator=generator, dtype=torch.float64)
        total_in += grad
        total_sent += sc.decode(pipe.compress(grad)).to_dense()
    residual = pipe.states[""].feedback["residual"]
    torch.testing.assert_close(total_sent + residual, total_in, rtol=0, atol=1e-9)


def test_a_lossy_index_pipeline_takes_tensors_past_the_scan_limit_of_an_unasked_decode(monkeypatch):
    """The pipeline decodes its own Bloom payload to feed back what receivers will see; it knows the
    tensor, so it says which, and a tensor longer than decode scans unasked (2^24; lowered here) works."""
    monkeypatch.setattr(sc.payload, "SCAN_WITHOUT_EXPECT", 100)
    pipe = sc.Pipeline("topk(ratio=0.05)+residual+bloom(policy=p0)+fp32", seed=1)
    grad = torch.randint(-50, 51, (1000,), generator=torch.Generator().manual_seed(0)).float()
    payload = pipe.compress(grad)
    with pytest.raises(sc.PayloadError, match="expect"):
        sc.decode(payload)
    sent = sc.decode(payload, expect=grad.shape).to_dense()
    assert torch.equal(sent + pipe.states[""].feedback["residual"], grad)


def test_without_feedback_unsent_entries_are_dropped_and_the_input_is_untouched():
    pipe = sc.Pipeline("topk(k=1)+none+raw+fp32")
    grad = torch.tensor([1.0, -3.0, 2.0])
    sent = sc.decode(pipe.compress(grad)).to_dense()
    assert sent.tolist() == [0.0, -3.0, 0.0] and grad.tolist() == [1.0, -3.0, 2.0]
    pipe_fb = sc.Pipeline("topk(k=1)+residual+raw+fp32")
    pipe_fb.compress(grad)
    assert grad.tolist() == [1.0, -3.0, 2.0]  # residual feedback never writes into the caller's tensor


def test_same_spec_and_seed_give_identical_payloads(global_rng_untouched):
    spec = "randomk(ratio=0.1)+residual+rice+qsgd(bits=4)"
    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(1000, generator=generator) for _ in range(5)]
    rank0, rank1, other = sc.Pipeline(spec, seed=3), sc.Pipeline(spec, seed=3), sc.Pipeline(spec, seed=4)
    for grad in grads:
        payload = rank0.compress(grad, "layer")
        assert payload == rank1.compress(grad, "layer")
    assert [other.compress(g, "layer") for g in grads] != [rank0.compress(g, "layer") for g in grads]


def test_state_dict_resumes_bit_identically():
    spec = "randomk(ratio=0.05)+residual+huffman+qsgd(bits=4)"
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(500, generator=generator) for _ in range(8)]
    straight = sc.Pipeline(spec, seed=1)
    expected = [straight.compress(g, "w") for g in grads]
    first = sc.Pipeline(spec, seed=1)
    for g in grads[:4]:
        first.compress(g, "w")
    saved = first.state_dict()
    resumed = sc.Pipeline(spec, seed=1)
    resumed.load_state_dict(saved)
    assert [resumed.compress(g, "w") for g in grads[4:]] == expected[4:]
    with pytest.raises(sc.SparseCommError, match="state is for"):
        sc.Pipeline("topk(k=1)", seed=1).load_state_dict(saved)


def test_step_report_gives_selected_against_target():
    pipe = sc.Pipeline("dgc(ratio=0.01)+residual+rice+fp16")
    pipe.compress(torch.randn(100_000, generator=torch.Generator().manual_seed(0)), "w")
    report = pipe.states["w"].last
    assert report is not None and report.target == 1000 and 700 <= report.selected <= 1300
    assert report.payload_bytes < 100_000 * 4 / 10


def test_a_pipeline_rejects_nonfinite_gradients_before_they_enter_the_residual():
    pipe = sc.Pipeline("topk(k=1)+residual+raw+fp32")
    with pytest.raises(sc.SparseCommError, match="non-finite"):
        pipe.compress(torch.tensor([float("nan"), 1.0, 0.0]), "w")


def test_pipeline_encodes_with_the_generator_it_seeds():
    one = sc.Pipeline("topk(k=5)+none+raw+qsgd(bits=2)", seed=0).compress(torch.arange(10.0))
    again = sc.encode(sc.Pipeline("topk(k=5)").spec.sparsifier.sparsify(torch.arange(10.0)), "raw", "qsgd(bits=2)",
                      rng=np.random.default_rng([0, 0, 0]))
    assert sc.decode(one).indices.tolist() == sc.decode(again).indices.tolist()


def test_one_nonfinite_policy_serves_every_path():
    from sparsecomm.pipeline import screen_nonfinite

    good = torch.tensor([1.0, 2.0])
    assert screen_nonfinite(good, "raise") == (good, False)
    bad = torch.tensor([1.0, float("nan"), float("inf")])
    zeroed, must_raise = screen_nonfinite(bad, "zero")
    assert zeroed.tolist() == [1.0, 0.0, 0.0] and not must_raise
    assert screen_nonfinite(bad, "skip") == (None, False)
    assert screen_nonfinite(bad, "raise") == (None, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("feedback", ["residual", "dgc_momentum(momentum=0.9)"])
def test_a_half_precision_gradients_small_steady_entries_are_held_back_not_rounded_away(dtype, feedback):
    """Ten large entries win every step; the rest, small and steady, wait in the feedback. Kept in
    the gradient's half precision, a held-back sum of about 0.25 no longer grows by 3e-4 a step
    (half its spacing there): fp32 keeps every step's, so what was sent plus what is held is what
    came in."""
    pipe = sc.Pipeline(f"topk(ratio=0.01)+{feedback}+raw+fp32")
    grad = torch.full((1000,), 3e-4, dtype=dtype)
    grad[:10] = 0.5
    sent, steps = torch.zeros(1000, dtype=torch.float64), 1500
    for _ in range(steps):
        sent += sc.decode(pipe.compress(grad, key="w")).to_dense().double()
    state = pipe.states["w"].feedback
    name = "residual" if feedback == "residual" else "accumulated"
    assert state[name].dtype == torch.float32
    if feedback == "residual":  # what came in, to fp32's rounding of the steps' sums
        came_in = steps * grad.double()
        torch.testing.assert_close(sent + state[name].double(), came_in, rtol=1e-4, atol=1e-3)
    small = sent[10:].sum() + state[name][10:].double().sum()
    assert small > 0.9 * 990 * float(grad[10]) * steps * (1 if feedback == "residual" else 5)


@pytest.mark.parametrize("preset", sorted(sc.PRESETS))
def test_every_presets_canonical_text_parses_back_and_its_pipeline_state_loads(preset):
    """A joint codec (skcompress) codes the values too: its canonical text names no value codec,
    which parse_spec would refuse next to it, and a checkpoint stores that text."""
    from sparsecomm.spec import format_spec

    spec = sc.parse_spec(sc.PRESETS[preset].spec)
    assert sc.parse_spec(format_spec(spec)) == spec
    pipe = sc.Pipeline(spec)
    pipe.step(torch.randn(5000, generator=torch.Generator().manual_seed(1)), key="w")
    fresh = sc.Pipeline(spec)
    fresh.load_state_dict(pipe.state_dict())
    assert fresh.states["w"].step == 1


def skip_a_half_precision_nan(rank: int, world: int) -> list[str]:
    results = []
    with sc.GradientReducer("topk(ratio=0.01)+residual+rice+fp32+allgather", nonfinite="skip") as reducer:
        for step in range(2):
            grad = torch.full((20_000,), 0.01 * (rank + 1), dtype=torch.bfloat16)
            grad[:50] = 1.0
            if step == 1 and rank == 1:
                grad[3] = float("nan")
            results.append(str(reducer.reduce("w", grad).dtype))
    return results


def test_a_half_precision_gradient_skipped_on_one_rank_still_matches_the_others_call():
    """A rank that skips its non-finite gradient sends an empty contribution of the gradient's
    dtype: the values the others send are in it too, though their feedback is fp32."""
    from sparsecomm.launch import run_local

    assert run_local(2, skip_a_half_precision_nan) == [["torch.bfloat16"] * 2] * 2


def test_a_half_precision_tensor_sent_whole_keeps_its_codecs_error_in_fp32():
    from sparsecomm.pipeline import Segment

    pipe = sc.Pipeline("topk(ratio=0.1)+residual+rice+int8")
    grad = torch.randn(600, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    segments = (Segment("w", 0, 500), Segment("b", 500, 100, whole=True))
    for _ in range(3):
        pipe.step(grad, "bucket", segments=segments)
    assert pipe.states["b"].codec_error.dtype == torch.float32
    assert pipe.states["w"].feedback["residual"].dtype == torch.float32
