"""Parameters too small to select from (biases, norms) travel whole inside a compressed bucket: every
nonzero, no sparsifier. A lossy codec still rounds them — what it loses is held for the tensor and
sent with its next step, so over steps the receivers get all of it, as error feedback gives the
selected parameters. A tensor sent whole on its own takes the plain route where the pipeline's
codecs would cost more than an fp32 all_reduce."""

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.adaptive.flush import flush
from sparsecomm.pipeline import Segment, StepOutput
from sparsecomm.presets import resolve
from sparsecomm.reducer.call import Route, route_of
from sparsecomm.reducer.config import ReducerConfig

BIG, SMALL = 5000, 300
SEGMENTS = [Segment("w", 0, BIG), Segment("b", BIG, SMALL, whole=True)]
LOSSY = ["topk(ratio=0.01)+residual+rice+int8",
         "topk(ratio=0.01)+residual+raw+fp16",
         "topk(ratio=0.01)+residual+raw+qsgd(bits=4,bucket=64)",
         "topk(ratio=0.01)+residual+raw+polyfit",
         "adaptive+dgc_momentum(masking=false,nesterov=true)+rice+int8+allgather"]


def bucket(step: int) -> torch.Tensor:
    rng = np.random.default_rng(step)
    return torch.from_numpy(np.concatenate([rng.laplace(size=BIG), rng.normal(1.0, 0.3, SMALL)]).astype(np.float32))


def received_bias(output: StepOutput) -> torch.Tensor:
    return output.selection.to_dense().reshape(-1)[BIG:]


@pytest.mark.parametrize("spec", LOSSY)
def test_what_a_lossy_codec_rounds_off_a_whole_tensor_arrives_with_its_next_steps(spec):
    pipe = sc.Pipeline(spec)
    sent = received = torch.zeros(SMALL, dtype=torch.float64)
    for step in range(6):
        grad = bucket(step)
        output = pipe.step(grad, "bucket", make_payload=True, segments=SEGMENTS)
        sent = sent + grad[BIG:].double()
        received = received + received_bias(output).double()
        held = pipe.states["b"].codec_error
        assert held is not None and float(held.abs().max()) > 0, "the codec rounded nothing: not a lossy case"
        # received so far + held now = everything given so far
        assert torch.allclose(received + held.double(), sent, rtol=0, atol=1e-5), f"step {step}"


def test_without_the_held_error_a_lossy_codec_drifts():
    """The property the test above checks is one that can fail: the same steps with the held error
    dropped each time leave the received sum further from the sent one than one step's rounding."""
    pipe = sc.Pipeline(LOSSY[0])
    drift = torch.zeros(SMALL, dtype=torch.float64)
    for step in range(20):
        grad = bucket(step)
        drift += (received_bias(pipe.step(grad, "bucket", make_payload=True, segments=SEGMENTS))
                  - grad[BIG:]).double()
        last_round = pipe.states["b"].codec_error.abs().max()
        pipe.states["b"].codec_error = None
    assert float(drift.abs().max()) > 3 * float(last_round)


@pytest.mark.parametrize("spec", ["topk(ratio=0.01)+residual+rice+fp32", "topk(ratio=0.01)+residual+raw+zstd"])
def test_a_lossless_codec_sends_a_whole_tensor_exactly_and_holds_nothing(spec):
    pipe = sc.Pipeline(spec)
    for step in range(3):
        grad = bucket(step)
        assert torch.equal(received_bias(pipe.step(grad, "bucket", make_payload=True, segments=SEGMENTS)),
                           grad[BIG:])
        assert pipe.states["b"].codec_error is None


def test_a_dense_step_sends_what_was_held_and_holds_nothing_after():
    """On a dense step (the ``adaptive`` pipeline's fp32 or fp16 all_reduce) a whole tensor goes with
    what its last sparse step's codec took off it; fp16's own rounding is not held, as DDP's fp16
    hook holds none."""
    for dtype, scale in ((torch.float32, 1.0), (torch.float16, 0.5)):
        pipe = sc.Pipeline(LOSSY[-1])
        pipe.step(bucket(0), "bucket", make_payload=True, segments=SEGMENTS, density=0.01)
        held = pipe.states["b"].codec_error.clone()
        grad = bucket(1)
        wire = torch.empty(BIG + SMALL, dtype=dtype)
        flush(pipe, grad, "bucket", SEGMENTS, out=wire, scale=scale)
        assert torch.equal(wire[BIG:], ((grad[BIG:] + held) * scale).to(dtype))
        assert pipe.states["b"].codec_error is None


def test_the_held_error_is_checkpointed_so_a_resumed_run_sends_the_same():
    spec = LOSSY[0]
    whole_run, first_half = sc.Pipeline(spec), sc.Pipeline(spec)
    for step in range(3):
        for pipe in (whole_run, first_half):
            pipe.step(bucket(step), "bucket", make_payload=True, segments=SEGMENTS)
    resumed = sc.Pipeline(spec)
    resumed.load_state_dict(first_half.state_dict())
    assert torch.equal(resumed.states["b"].codec_error, whole_run.states["b"].codec_error)
    for step in range(3, 5):
        expected = whole_run.step(bucket(step), "bucket", make_payload=True, segments=SEGMENTS)
        got = resumed.step(bucket(step), "bucket", make_payload=True, segments=SEGMENTS)
        assert expected.payload == got.payload


@pytest.mark.parametrize("spec, vector, matrix, rows", [
    # DGC's rule sends vectors whole at any size: by plain all_reduce, where fp32 values and
    # their indices would cost more; its sparsifier selects from an embedding's rows too
    ("dgc", Route.PLAIN, Route.COMPRESSED, Route.COMPRESSED),
    ("dgc(ratio=0.001)+dgc_momentum+rle+int8+allgather", Route.COMPRESSED, Route.COMPRESSED, Route.COMPRESSED),
    # top-k's rule: by size; a sparse gradient's rows go whole
    ("topk(ratio=0.01)+residual+raw+fp32+allgather", Route.COMPRESSED, Route.COMPRESSED, Route.ROWS),
])
def test_the_route_of_what_a_sparsifier_sends_whole_or_selects_from(spec, vector, matrix, rows):
    config = ReducerConfig(resolve(spec))
    embedding = torch.sparse_coo_tensor(torch.tensor([[3, 70]]), torch.ones(2, 64), (100, 64), check_invariants=True)
    assert [route_of(tensor, None, config, None) for tensor in (torch.ones(5001), torch.ones(80, 64), embedding)] \
        == [vector, matrix, rows]
    assert route_of(torch.ones(300), None, config, None) is Route.PLAIN  # below dense_below: plain whatever the rule
