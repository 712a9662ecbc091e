"""Pipelines run where the gradient lives: sparsify and feedback on its device, codecs on the host,
decode back onto any device. CUDA cases run wherever a GPU is present."""

import pytest
import torch

import sparsecomm as sc

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
SPECS = ["topk(ratio=0.01)+residual+rice+fp16", "dgc(ratio=0.01)+residual+huffman+qsgd(bits=4)",
         "randomk(ratio=0.01)+residual+bitmap+fp32", "bucketed_topk(k=1)+none+rle+bf16",
         "block_topk(ratio=0.05,block=64)+residual+delta_binary+deflate"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
def test_pipeline_keeps_state_on_the_gradient_device(device, spec):
    generator = torch.Generator(device=device).manual_seed(0)
    pipe = sc.Pipeline(spec)
    for _ in range(3):
        grad = torch.randn(256, 128, generator=generator, device=device)
        received = sc.decode(pipe.compress(grad, "w"), device=device)
        assert received.values.device.type == device and received.shape == grad.shape
    residual = pipe.states["w"].feedback.get("residual")
    assert residual is None or residual.device.type == device


def test_state_a_checkpoint_left_on_another_device_moves_to_the_gradients():
    """A checkpoint loaded onto the CPU, resumed where the gradients are elsewhere (here torch's meta
    device stands for a GPU): the codec's error of a tensor sent whole moves to the gradient's
    device, and DGC's momentum buffer elsewhere does not count as one a bucket's flush can use."""
    from sparsecomm.feedback.dgc_momentum import DGCMomentum
    from sparsecomm.pipeline import TensorState, with_codec_error

    state = TensorState(codec_error=torch.ones(6))
    piece = torch.zeros(2, 3, device="meta")
    assert with_codec_error(piece, state).device.type == "meta"
    assert state.codec_error.device.type == "meta"  # moved once, kept there
    momentum = {"averaged": True, "momentum_buffer": torch.zeros(6)}
    assert DGCMomentum().flush_sends_gradient(6, torch.zeros(6), momentum)
    assert not DGCMomentum().flush_sends_gradient(6, torch.zeros(6, device="meta"), momentum)


def test_rows_rounding_errors_a_checkpoint_left_on_another_device_move_to_the_rows():
    from sparsecomm.reducer.paths.rows import RowsPath

    path = RowsPath(None)  # its parts are not read here
    path.load_state_dict({"embedding.weight": torch.ones(8)})
    assert path._errors("embedding.weight", torch.device("meta")).device.type == "meta"
    assert path.errors["embedding.weight"].device.type == "meta"  # moved once, kept there
    assert path._errors("other", torch.device("meta")) is None


@pytest.mark.parametrize("rows", [2, 3, 4])
def test_a_sketchs_median_read_is_torchs_lower_median(rows):
    from sparsecomm.transport.sketch_allreduce import median_read

    generator = torch.Generator().manual_seed(rows)
    sketch = torch.randn(rows, 64, generator=generator)
    buckets = torch.randint(64, (rows, 500), generator=generator)
    signs = torch.randint(2, (rows, 500), generator=generator).float().mul_(2).sub_(1)
    expected = (torch.gather(sketch, 1, buckets) * signs).median(dim=0).values
    assert torch.equal(median_read(sketch, buckets, signs), expected)
