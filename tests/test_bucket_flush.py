"""A dense step's flush of a whole bucket: its residuals flushed as one buffer (`FlatResidual`), or
its gradient alone where every tensor's feedback sends nothing else, send and keep what the flush of
each tensor on its own does, across sparse steps, fp16 and fp32 dense steps and a checkpoint, in a
few ops whatever the number of tensors."""

import functools

import pytest
import torch

from sparsecomm.adaptive.flat_residual import FlatResidual
from sparsecomm.adaptive.flush import flush, update_flushed
from sparsecomm.bench.op_counts import count_ops
from sparsecomm.pipeline import Pipeline, Segment, TensorState

SPEC = "adaptive+residual+rice+int8+allgather"  # int8: lossy, so the tensors sent whole keep a codec's error
SIZES = [(3000, False), (40, True), (5000, False), (7, True), (1200, False)]


def bucket() -> tuple[list[Segment], int]:
    segments, start = [], 0
    for index, (numel, whole) in enumerate(SIZES):
        segments.append(Segment(f"p{index}", start, numel, whole))
        start += numel
    return segments, start


def gradient(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-2


def residuals(pipeline: Pipeline, segments: list[Segment]) -> torch.Tensor:
    return torch.cat([pipeline.states[s.key].feedback["residual"].reshape(-1) for s in segments if not s.whole])


@pytest.mark.parametrize("modes", ["fp16 fp16 sparse fp16 fp32 fp32 sparse fp32 fp16",
                                   "fp32 sparse sparse fp16 checkpoint fp16 sparse fp32"])
def test_a_buckets_flush_on_one_buffer_sends_and_keeps_what_each_tensors_own_flush_does(modes):
    segments, numel = bucket()
    apart, together = Pipeline(SPEC), Pipeline(SPEC)
    buffers: dict[str, FlatResidual] = {}
    for step, mode in enumerate(modes.split()):
        grad = gradient(numel, step)
        if mode == "checkpoint":  # a restored pipeline's states hold tensors of their own
            together.load_state_dict(together.state_dict())
            continue
        if mode == "sparse":
            for pipeline in (apart, together):
                pipeline.step(grad, "b", make_payload=True, segments=segments, density=0.05)
            continue
        dtype, scale = (torch.float16, 0.5) if mode == "fp16" else (torch.float32, 1.0)
        out, reference = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        flush(apart, grad, "b", segments, out=reference, scale=scale)
        flush(together, grad, "b", segments, out=out, scale=scale, buckets=buffers)
        assert torch.equal(out, reference), f"step {step}"
        assert torch.equal(residuals(together, segments), residuals(apart, segments)), f"step {step}"
        assert all(together.states[s.key].codec_error is None for s in segments if s.whole)
        held = [together.states[s.key].feedback["residual"] for s in segments if not s.whole]
        assert all(view._base is buffers["b"].buffer for view in held)  # one buffer, each tensor a view of it
    assert float(residuals(together, segments).abs().max()) > 0 or modes.endswith("fp32")


def test_what_a_bucket_sends_and_keeps_adds_up_to_every_gradient_fed_in():
    """Sparse steps, fp16 steps (which keep their rounding) and fp32 steps on one buffer: what was
    sent plus what is held is the sum of the gradients of the tensors that are not sent whole."""
    segments, numel = bucket()
    pipeline, buffers = Pipeline(SPEC), {}
    selected = torch.cat([torch.arange(s.start, s.start + s.numel) for s in segments if not s.whole])
    fed, sent = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for step, mode in enumerate(["sparse", "fp16", "sparse", "sparse", "fp16", "fp32", "sparse", "fp16"]):
        grad = gradient(numel, 100 + step)
        fed += grad.double()
        if mode == "sparse":
            output = pipeline.step(grad, "b", make_payload=True, segments=segments, density=0.02)
            sent += output.selection.to_dense().reshape(-1).double()
            continue
        dtype, scale = (torch.float16, 0.25) if mode == "fp16" else (torch.float32, 1.0)
        out = torch.empty(numel, dtype=dtype)
        flush(pipeline, grad, "b", segments, out=out, scale=scale, buckets=buffers)
        sent += out.double() / scale
    held = torch.zeros(numel, dtype=torch.float64)
    held[selected] = residuals(pipeline, segments).double()
    assert torch.allclose((sent + held)[selected], fed[selected], rtol=0, atol=1e-6)


def test_residuals_the_device_route_holds_as_views_of_its_buffer_are_used_in_place():
    segments, numel = bucket()
    pipeline = Pipeline(SPEC)
    device_buffer = torch.zeros(numel + 1)  # the device route's: one entry of padding
    for segment in segments:
        state = pipeline.states.setdefault(segment.key, TensorState())
        if not segment.whole:
            state.feedback["residual"] = device_buffer[segment.start:segment.start + segment.numel].fill_(0.5)
    buffers: dict[str, FlatResidual] = {}
    out = torch.empty(numel)
    flush(pipeline, torch.zeros(numel), "b", segments, out=out, buckets=buffers)
    assert buffers["b"].buffer is device_buffer  # found in place, nothing copied
    whole = torch.cat([torch.arange(s.start, s.start + s.numel) for s in segments if s.whole])
    expected = torch.full((numel,), 0.5)
    expected[whole] = 0.0
    assert torch.equal(out, expected) and float(device_buffer.abs().max()) == 0.0


MOMENTUM = "adaptive+dgc_momentum(nesterov=true,masking=false)+rice+int8+allgather"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: its feedback is kept in fp32
@pytest.mark.parametrize("spec", [MOMENTUM, SPEC])
def test_a_bucket_flushes_in_a_few_ops_however_many_tensors_it_holds(spec, dtype):
    """Once DGC's momentum is the ranks' common one, a dense step sends the gradient alone: one op
    for the bucket. A residual takes a few. The flush of each tensor on its own takes a few each."""
    counts = {}
    for tensors in (5, 40):
        segments = [Segment(f"p{i}", 100 * i, 100, whole=i % 5 == 1) for i in range(tensors)]
        numel, grad = 100 * tensors, gradient(100 * tensors, 7).to(dtype)
        pipeline, buffers = Pipeline(spec), {}
        out = torch.empty(numel, dtype=torch.float16)
        for _ in range(2):  # the first dense step sends what sparse steps held, and makes the momentum common
            flush(pipeline, grad, "b", segments, out=out, scale=0.5, buckets=buffers)
            update_flushed(pipeline, torch.zeros(numel), "b", segments)
        counts[tensors] = count_ops(functools.partial(flush, pipeline, grad, "b", segments, out=out, scale=0.5,
                                                      buckets=buffers), 3).ops
        if spec == MOMENTUM:
            assert torch.equal(out, (grad * 0.5).half())  # the gradient itself, rounded as DDP's fp16 hook
    assert counts[40] <= counts[5] + 2 and counts[40] < 20, counts
