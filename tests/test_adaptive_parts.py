"""The parts of the ``adaptive`` pipeline that work on one rank: the sparsifier, the int8 value
codec, and the feedback's flush (a dense step that loses nothing; with DGC's momentum, the
momentum of the average)."""

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.components import Adaptive, DGCMomentum, Feedback, Int8Values, NoFeedback, Residual
from sparsecomm.errors import PayloadError, SpecError


def laplace(n: int, seed: int = 0) -> torch.Tensor:
    return torch.distributions.Laplace(0.0, 1.0).sample((n,)) if seed is None else torch.from_numpy(
        np.random.default_rng(seed).laplace(size=n).astype(np.float32))


# -- the sparsifier ------------------------------------------------------------------------------
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.25])
def test_adaptive_keeps_the_largest_entries_near_its_density_in_index_order(density):
    grad = laplace(200_000)
    chosen = Adaptive().at_density(density).sparsify(grad, torch.Generator().manual_seed(1))
    k = round(density * grad.numel())
    assert 0.7 * k <= chosen.nnz <= 1.5 * k
    assert bool((chosen.indices[1:] > chosen.indices[:-1]).all()), "selection must stay in index order"
    kept = torch.zeros(grad.numel(), dtype=torch.bool)
    kept[chosen.indices] = True
    assert float(grad.abs()[kept].min()) >= float(grad.abs()[~kept].max())  # a threshold: nothing larger left out
    assert torch.equal(chosen.values, grad[chosen.indices])


def test_adaptive_sends_every_nonzero_at_density_one_and_is_exact_on_small_tensors():
    grad = torch.tensor([0.0, 3.0, -1.0, 0.0, 2.0])
    assert Adaptive().sparsify(grad).indices.tolist() == [1, 2, 4]  # density 1: every nonzero
    small = laplace(1000)
    chosen = Adaptive().at_density(0.01).sparsify(small)
    assert chosen.indices.tolist() == sorted(torch.topk(small.abs(), 10).indices.tolist())


def test_adaptive_density_is_clamped_to_its_floor_and_one_and_its_settings_are_checked():
    assert Adaptive(floor=0.01).at_density(1e-6).density == 0.01
    assert Adaptive().at_density(7.0).density == 1.0
    assert Adaptive().at_density(1e-6).density == 0.001  # the floor left to the optimizer: untold, SGD's
    for bad in ["adaptive(budget=-1)", "adaptive(floor=-0.1)", "adaptive(floor=2)", "adaptive(probe=-2)",
                "adaptive(sample=2)"]:
        with pytest.raises(SpecError):
            sc.SPARSIFIERS.parse(bad)


def test_pipeline_density_is_only_for_the_adaptive_sparsifier():
    with pytest.raises(sc.SparseCommError, match="only the adaptive sparsifier"):
        sc.Pipeline("topk(ratio=0.1)+residual").step(torch.ones(100), "w", density=0.5)


# -- the int8 value codec -------------------------------------------------------------------------
@pytest.mark.parametrize("bucket", [1, 7, 512])
def test_int8_decodes_to_what_as_decoded_says_and_within_a_bucket_scale_over_254(bucket):
    codec = Int8Values(bucket=bucket)
    values = laplace(5000, seed=3) * torch.logspace(-3, 2, 5000)
    section = codec.encode(values, np.random.default_rng(0))
    decoded = codec.decode(memoryview(section), values.numel(), torch.float32)
    assert torch.equal(decoded, codec.as_decoded(values))  # error feedback may learn it without decoding
    padded = torch.cat([values.abs(), values.new_zeros(-values.numel() % bucket)])
    scales = padded.view(-1, bucket).amax(1).repeat_interleave(bucket)[: values.numel()]
    assert bool(((decoded - values).abs() <= scales / 254 * (1 + 1e-6)).all())
    assert bool((decoded * values >= 0).all())  # never a flipped sign
    assert len(section) == 4 * -(-values.numel() // bucket) + values.numel()


def test_int8_error_contracts_so_error_feedback_keeps_up():
    values = laplace(512 * 64, seed=4)
    error = Int8Values().as_decoded(values) - values
    assert float(error.square().sum()) <= 512 / (4 * 127**2) * float(values.square().sum())


def test_int8_refuses_out_of_range_levels_and_bad_scales():
    codec = Int8Values(bucket=4)
    good = bytearray(codec.encode(torch.tensor([1.0, -2.0, 0.5]), np.random.default_rng(0)))
    for tamper in (lambda b: b.__setitem__(4, 0x80),                      # level -128
                   lambda b: b.__setitem__(slice(0, 4), np.float32(-1).tobytes()),
                   lambda b: b.__setitem__(slice(0, 4), np.float32(np.inf).tobytes())):
        bad = bytearray(good)
        tamper(bad)
        with pytest.raises(PayloadError):
            codec.decode(memoryview(bytes(bad)), 3, torch.float32)
    with pytest.raises(PayloadError, match="does not fit"):
        codec.decode(memoryview(bytes(good[:-1])), 3, torch.float32)


# -- the feedback's flush --------------------------------------------------------------------------
@pytest.mark.parametrize("feedback", [Residual(), NoFeedback()], ids=lambda f: f.to_spec())
def test_a_dense_flush_is_update_with_every_entry_however_it_is_computed(feedback):
    """Mixed sparse and dense (fp32 and fp16) steps: each feedback's own flush (with its shortcut
    while nothing is kept) sends what the generic one — accumulate, then `update` with every entry
    as sent — sends, and leaves the same state."""
    fast, generic = {}, {}
    for step in range(8):
        grad = laplace(3000, seed=step)
        if step % 3 == 2:  # a sparse step: the 100 largest
            for state in (fast, generic):
                accumulated = feedback.accumulate(grad, state)
                feedback.update(accumulated, sc.SPARSIFIERS.create("topk", {"k": 100}).sparsify(accumulated), state)
            continue
        dtype, scale = (torch.float16, 0.5) if step % 2 else (torch.float32, 1.0)
        out, reference = torch.empty(3000, dtype=dtype), torch.empty(3000, dtype=dtype)
        feedback.flush(grad, fast, out, scale)
        Feedback.flush(feedback, grad, generic, reference, scale)
        assert torch.equal(out, reference), f"step {step}"
        for name, value in generic.items():
            if isinstance(value, torch.Tensor):
                assert torch.allclose(fast[name], value, rtol=0, atol=1e-7), f"{name} after step {step}"


def test_an_fp16_flush_keeps_the_rounding_in_the_residual():
    state = {}
    grad = laplace(1000, seed=9) * 1e-3
    out = torch.empty(1000, dtype=torch.float16)
    Residual().flush(grad, state, out, scale=0.25)
    assert torch.equal(out.to(torch.float32) / 0.25 + state["residual"], grad)  # sent + kept = everything
    assert float(state["residual"].abs().max()) > 0


MOMENTA = [DGCMomentum(momentum=0.9, masking=False, nesterov=True), DGCMomentum(momentum=0.9, masking=False)]


def dense_step(feedback, grads, states, scale=1.0, dtype=torch.float32):
    """One dense step of every simulated rank: flush, all_reduce (the mean of the wires, in the
    units of the gradient), `update_flushed` on each rank's copy of the average."""
    wires = [torch.empty(grad.numel(), dtype=dtype) for grad in grads]
    for grad, state, wire in zip(grads, states, wires, strict=True):
        feedback.flush(grad, state, wire, scale)
    average = torch.stack([wire.to(torch.float32) for wire in wires]).mean(0) / scale
    updates = []
    for state in states:
        update = average.clone()
        feedback.update_flushed(update, state)
        updates.append(update)
    return wires, updates


@pytest.mark.parametrize("feedback", MOMENTA, ids=lambda f: f.to_spec())
def test_dgc_dense_steps_send_the_gradient_itself_and_apply_sgds_momentum_to_the_average(feedback):
    """Dense steps from the start: the wire is the gradient (times the scale), and the update is what
    torch's SGD with the same momentum makes of the average — the same on every rank."""
    states = [{}, {}]
    parameter = torch.zeros(2000, requires_grad=True)
    optimizer = torch.optim.SGD([parameter], lr=1.0, momentum=feedback.momentum, nesterov=feedback.nesterov)
    for step in range(6):
        grads = [laplace(2000, seed=10 * step + rank) for rank in range(2)]
        scale, dtype = (0.5, torch.float16) if step % 2 else (1.0, torch.float32)
        wires, updates = dense_step(feedback, grads, states, scale, dtype)
        for grad, wire in zip(grads, wires, strict=True):
            assert torch.equal(wire, (grad * scale).to(dtype))
        assert torch.equal(updates[0], updates[1])
        before = parameter.detach().clone()
        parameter.grad = torch.stack([wire.to(torch.float32) for wire in wires]).mean(0) / scale
        optimizer.step()
        assert torch.allclose(before - parameter.detach(), updates[0], rtol=1e-5, atol=1e-5), f"step {step}"


@pytest.mark.parametrize("shaped", [False, True], ids=["flat", "shaped"])
@pytest.mark.parametrize("feedback", MOMENTA, ids=lambda f: f.to_spec())
def test_dgc_momentum_delivers_every_gradient_in_full_across_switches_between_sparse_and_dense(feedback, shaped):
    """SGD's momentum delivers a gradient g over all later steps as g/(1−m) in total. Sparse steps
    (each rank's own momentum and residual) and exact dense steps (the common momentum, which takes
    over what the ranks held at the switch) in turn, then zero gradients until the momentum has
    died out: what every step applied adds up to the gradients fed in, over (1−m). ``shaped``:
    sparse steps see the tensor in its shape (a custom loop's), dense steps flat (a flush) — one
    state for both."""
    ranks, numel = 2, 3000
    states = [{} for _ in range(ranks)]
    fed, delivered = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    modes = ["sparse", "dense", "sparse", "sparse", "dense", "dense", "sparse"] + ["dense"] * 400
    for step, mode in enumerate(modes):
        grads = [laplace(numel, seed=100 * step + rank) if step < 7 else torch.zeros(numel) for rank in range(ranks)]
        fed += torch.stack(grads).double().mean(0)
        if mode == "dense":
            _, updates = dense_step(feedback, grads, states)
            assert torch.equal(updates[0], updates[1])
            delivered += updates[0].double()
            continue
        sent = torch.zeros(numel)
        for grad, state in zip(grads, states, strict=True):
            accumulated = feedback.accumulate(grad.view(60, 50) if shaped else grad, state)
            selection = sc.SPARSIFIERS.create("topk", {"k": 150}).sparsify(accumulated)
            feedback.update(accumulated, selection, state)
            sent += selection.to_dense().reshape(-1) / ranks
        delivered += sent.double()
    assert torch.allclose(delivered, fed / (1 - feedback.momentum), rtol=1e-4, atol=1e-4)


def test_a_residual_held_by_sparse_steps_in_the_tensors_shape_goes_with_a_flat_dense_step():
    """A custom loop's sparse step keeps the residual in the tensor's shape; the dense step's flush
    sees the tensor flat. It must send what was held, not start a new residual."""
    feedback, state = Residual(), {}
    fed, delivered = torch.zeros(3000), torch.zeros(3000)
    for step in range(3):
        grad = laplace(3000, seed=step)
        fed += grad
        accumulated = feedback.accumulate(grad.view(60, 50), state)
        selection = sc.SPARSIFIERS.create("topk", {"k": 100}).sparsify(accumulated)
        feedback.update(accumulated, selection, state)
        delivered += selection.to_dense().reshape(-1)
    out = torch.empty(3000)
    feedback.flush(torch.zeros(3000), state, out)
    assert torch.allclose(delivered + out, fed, atol=1e-5)  # everything held went with the dense step
    assert float(state["residual"].abs().max()) == 0.0


def test_a_dense_step_that_fails_before_its_sum_arrives_changes_no_momentum():
    """A flush whose all_reduce never completes (a non-finite sum raised) leaves the state as it
    was: the next dense step sends the same."""
    feedback = MOMENTA[0]
    state = {}
    for step in range(3):  # sparse steps: this rank holds momentum and a residual
        accumulated = feedback.accumulate(laplace(1000, seed=step), state)
        feedback.update(accumulated, sc.SPARSIFIERS.create("topk", {"k": 50}).sparsify(accumulated), state)
    held = {name: value.clone() for name, value in state.items() if isinstance(value, torch.Tensor)}
    first, again = torch.empty(1000), torch.empty(1000)
    feedback.flush(laplace(1000, seed=7), state, first)
    feedback.flush(laplace(1000, seed=7), state, again)
    assert torch.equal(first, again) and not torch.equal(first, laplace(1000, seed=7))  # it sent what was held
    assert all(torch.equal(state[name], value) for name, value in held.items())


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_an_untimed_dense_step_is_priced_by_what_its_all_reduce_puts_on_each_link(world_size):
    """The link's throughput is timed as a ring all_reduce's 2(P−1)/P of the tensor on each rank's
    link over its time: the same all_reduce is predicted to take that time again."""
    from sparsecomm.adaptive.config import AdaptiveConfig
    from sparsecomm.adaptive.costs import Costs


    numel, compute_s, all_reduce_s = 1_000_000, 0.010, 0.060
    costs = Costs(AdaptiveConfig(), Adaptive(dense_start=0), world_size)
    costs.total_numel = costs.budget_numel = numel
    throughput = 2 * (world_size - 1) / world_size * 4 * numel / all_reduce_s
    costs.observe_link(throughput, 2 * throughput)  # fp16's link carries as many bytes a second
    costs.compute_s.append(compute_s)
    costs.max_magnitude = 1.0  # fp16 allowed
    predicted = costs.predicted(costs.step_budget())
    assert predicted[Mode.FP32][0] == pytest.approx(compute_s + all_reduce_s)
    fp16 = compute_s + all_reduce_s / 4  # half the bytes at twice the rate, and fp16's margin
    assert predicted[Mode.FP16][0] == pytest.approx(fp16 * (1 + AdaptiveConfig().fp16_margin))


def test_a_checkpoint_keeps_the_last_plans_density():
    """Whether an exploring step follows a sparse one held back at the floor reads its density."""
    from sparsecomm.adaptive.planner import Planner


    planner = Planner(Adaptive(), 2)
    planner.current = Plan(Mode.SPARSE, 0.0005)
    resumed = Planner(Adaptive(), 2)
    resumed.load_state_dict(planner.state_dict())
    assert resumed.current == Plan(Mode.SPARSE, 0.0005)
