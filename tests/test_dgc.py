"""Deep Gradient Compression's equations, checked by hand on tiny inputs."""

import pytest
import torch

import sparsecomm as sc
from sparsecomm.presets import resolve
from sparsecomm.sparsify.base import warmup_ratio


def run(spec: str, grads: list[torch.Tensor], world_size: int = 1) -> tuple[sc.Pipeline, list[sc.SparseGradient]]:
    pipe = sc.Pipeline(spec, world_size=world_size)
    sent = [sc.decode(pipe.compress(g, "w")) for g in grads]
    return pipe, sent


def test_unsent_coordinate_accumulates_the_discounted_sum_of_momentum_updates():
    """Coordinate 0 is never sent (coordinate 1 always wins top-1): after T steps
    v = Σ_t u_t with u_t = Σ_{s≤t} m^(t−s) g_s — eq. 7 unrolled."""
    m, grads = 0.9, [torch.tensor([0.1 * (t + 1), 100.0]) for t in range(6)]
    pipe, sent = run(f"topk(k=1)+dgc_momentum(momentum={m})+raw+fp32", grads)
    assert all(s.indices.tolist() == [1] for s in sent)
    g0 = [g[0].item() for g in grads]
    velocity = [sum(m ** (t - s) * g0[s] for s in range(t + 1)) for t in range(6)]
    state = pipe.states["w"].feedback
    assert state["accumulated"][0].item() == pytest.approx(sum(velocity), rel=1e-6)
    assert state["momentum_buffer"][0].item() == pytest.approx(velocity[-1], rel=1e-6)  # plain: u is b


def test_nesterov_momentum_follows_equation_10():
    m, g = 0.5, [torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0])]
    pipe, _ = run(f"topk(k=1)+dgc_momentum(momentum={m},nesterov=true,masking=false)+raw+fp32",
                  [torch.tensor([g[0][0], 9.0]), torch.tensor([g[1][0], 9.0])])
    u1 = m * (0 + 1.0)
    v1 = 0 + u1 + 1.0
    u2 = m * (u1 + 2.0)
    v2 = v1 + u2 + 2.0
    state = pipe.states["w"].feedback
    assert m * state["momentum_buffer"][0].item() == pytest.approx(u2)  # Nesterov's u is m·b
    assert state["accumulated"][0].item() == pytest.approx(v2)


def test_sent_values_are_the_accumulated_momentum_and_masking_clears_both_buffers():
    m = 0.9
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])]
    pipe, sent = run(f"topk(k=1)+dgc_momentum(momentum={m})+raw+fp32", grads)
    assert sent[0].values.tolist() == [1.0]  # v1 = u1 = g1
    assert sent[1].values.item() == pytest.approx(1.0)  # masked: u restarts from 0, so u2 = g2, v2 = u2
    state = pipe.states["w"].feedback
    assert state["momentum_buffer"][0].item() == 0.0 and state["accumulated"][0].item() == 0.0


def test_without_masking_momentum_keeps_pushing_sent_coordinates():
    pipe, sent = run("topk(k=1)+dgc_momentum(momentum=0.9,masking=false)+raw+fp32",
                     [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])])
    assert sent[1].values.item() == pytest.approx(1.9)  # u2 = 0.9·1 + 1, v2 = 0 + u2
    assert pipe.states["w"].feedback["accumulated"][0].item() == 0.0


def test_local_clipping_scales_the_threshold_by_world_size_to_the_minus_half():
    grad = torch.tensor([6.0, 8.0])  # norm 10
    pipe, _ = run("topk(k=2)+dgc_momentum(momentum=0.0,clip=4.0,masking=false)+raw+fp32", [grad], world_size=4)
    state = pipe.states["w"].feedback
    assert state["momentum_buffer"].tolist() == pytest.approx([1.2, 1.6])  # norm clipped to 4 / √4 = 2
    assert grad.tolist() == [6.0, 8.0]  # the caller's gradient is untouched
    pipe, _ = run("topk(k=2)+dgc_momentum(momentum=0.0,clip=40.0)+raw+fp32", [grad], world_size=4)
    # under the threshold: unscaled, then sent
    assert pipe.states["w"].feedback["momentum_buffer"].tolist() == [0.0, 0.0]


def test_warmup_raises_sparsity_exponentially_as_the_paper_says():
    densities = [warmup_ratio(0.001, step, 400) for step in (0, 100, 200, 300, 400, 10_000)]
    assert densities == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]  # 75%, 93.75%, 98.4375%, 99.6%, 99.9%
    pipe = sc.Pipeline("dgc(ratio=0.001,warmup=8)+dgc_momentum+rle+fp32")
    targets = []
    for _ in range(10):
        pipe.compress(torch.randn(100_000, generator=torch.Generator().manual_seed(0)), "w")
        targets.append(pipe.states["w"].last.target)
    assert targets == [25_000, 25_000, 6_250, 6_250, 1_563, 1_563, 391, 391, 100, 100]


def test_warmup_needs_a_ratio():
    with pytest.raises(sc.SpecError, match="warmup needs ratio"):
        sc.parse_spec("dgc(k=10,warmup=5)")


def test_dgc_preset_is_the_papers_configuration():
    spec = resolve("dgc")
    assert spec.sparsifier.name == "dgc" and spec.sparsifier.ratio == 0.001
    assert spec.feedback.name == "dgc_momentum" and spec.feedback.momentum == 0.9 and spec.feedback.masking
    assert (spec.index_codec.name, spec.value_codec.name) == ("rle", "fp32")  # 16-bit runs + 32-bit values


def test_presets_whose_parts_are_missing_say_so():
    available = sc.available_presets()
    assert {"dense", "dgc", "s2", "sparcml"} <= set(available)
    for name in set(sc.PRESETS) - set(available):
        with pytest.raises(sc.SpecError, match=f"preset '{name}' needs"):
            resolve(name)
    for name in available:
        resolve(name)


@pytest.mark.parametrize("nesterov", [False, True])
def test_tensors_sent_uncompressed_get_the_same_momentum_as_sgd_would_give_them(nesterov):
    m, averages = 0.9, [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 4.0])]
    feedback = sc.parse_spec(f"topk(k=1)+dgc_momentum(momentum={m},nesterov={str(nesterov).lower()})+raw+fp32").feedback
    state: dict = {}
    steps = [feedback.update_uncompressed(g, state) for g in averages]
    sgd_buffer = [averages[0], m * averages[0] + averages[1]]  # torch.optim.SGD's momentum buffer
    expected = [g + m * b for g, b in zip(averages, sgd_buffer, strict=True)] if nesterov else sgd_buffer
    for got, want in zip(steps, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert torch.equal(averages[0], torch.tensor([1.0, -2.0]))  # the average itself is left alone


@pytest.mark.parametrize("nesterov", [False, True])
def test_several_tensors_updated_in_place_at_once_get_the_same_bits_as_one_at_a_time(nesterov):
    feedback = sc.parse_spec(f"topk(k=1)+dgc_momentum(nesterov={str(nesterov).lower()})+raw+fp32").feedback
    generator = torch.Generator().manual_seed(0)
    shapes = [(512,), (16, 16), (10,)]
    one_by_one, together = [{} for _ in shapes], [{} for _ in shapes]
    for step in range(4):
        averages = [torch.randn(shape, generator=generator) * (step + 1) for shape in shapes]
        expected = [feedback.update_uncompressed(a, state) for a, state in zip(averages, one_by_one, strict=True)]
        feedback.update_uncompressed_(averages, together)
        for got, want in zip(averages, expected, strict=True):
            assert torch.equal(got, want)
    for mine, theirs in zip(together, one_by_one, strict=True):
        assert torch.equal(mine["momentum_buffer"], theirs["momentum_buffer"])


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_state_saved_with_u_continues_as_it_would_have(nesterov):
    """States saved before the buffer form hold DGC's u as "momentum" (Nesterov's u = m·b): a
    pipeline that loads one takes the same next step as one that kept running."""
    spec = f"topk(k=2)+dgc_momentum(momentum=0.5,nesterov={str(nesterov).lower()},masking=false)+raw+fp32"
    grads = [torch.tensor([1.0, -2.0, 0.5, 4.0]), torch.tensor([0.25, 1.0, -3.0, 2.0])]
    running = sc.Pipeline(spec)
    running.compress(grads[0], "w")
    saved = running.state_dict()
    feedback = saved["tensors"]["w"]["feedback"]
    buffer = feedback.pop("momentum_buffer")
    feedback["momentum"] = 0.5 * buffer if nesterov else buffer  # as the u form saved it
    resumed = sc.Pipeline(spec)
    resumed.load_state_dict(saved)
    expected, got = sc.decode(running.compress(grads[1], "w")), sc.decode(resumed.compress(grads[1], "w"))
    assert torch.equal(expected.indices, got.indices)
    torch.testing.assert_close(got.values, expected.values)
    assert "momentum" not in resumed.states["w"].feedback
