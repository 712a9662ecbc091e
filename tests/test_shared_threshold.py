"""How the ``adaptive`` pipeline shares a step's density out among its tensors: the density the plan
sets is every tensor's floor, and a tensor whose accumulated entries stand above the threshold at
which that density of the whole model would be taken sends those as well, from the next step on."""

import pytest
import torch

import sparsecomm as sc
from sparsecomm.adaptive.density import share_density
from sparsecomm.adaptive.planner import Planner
from sparsecomm.components import Adaptive
from sparsecomm.pipeline import Segment
from sparsecomm.sparsify.shared_threshold import density_shares, magnitude_sample

BIG, SMALL, DENSITY = 1_000_000, 50_000, 0.004


def normal(numel: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


def exact_share(tensors: dict[str, torch.Tensor], density: float, key: str) -> float:
    """The same share from every entry, by a sort: what the samples and the histogram estimate."""
    everything = torch.cat([t.abs() for t in tensors.values()])
    threshold = everything.topk(int(density * everything.numel())).values[-1]
    return max(1.0, float((tensors[key].abs() >= threshold).float().mean()) / density)


def test_a_tensor_whose_entries_stand_above_the_rest_gets_their_share_and_the_rest_keep_the_density():
    tensors = {"output": normal(BIG, 1.0, 0), "hidden": normal(SMALL, 3.0, 1)}
    shares = density_shares({key: (t.numel(), magnitude_sample(t, step=0)) for key, t in tensors.items()}, DENSITY)
    assert shares["output"] == 1.0  # never below the plan's density
    expected = exact_share(tensors, DENSITY, "hidden")
    assert expected > 10  # a case where the shares matter
    assert shares["hidden"] == pytest.approx(expected, rel=0.3)  # an eighth of an octave, sampled


def test_tensors_alike_keep_the_plans_density():
    tensors = {"a": normal(BIG, 1.0, 0), "b": normal(SMALL * 4, 1.0, 1)}
    shares = density_shares({key: (t.numel(), magnitude_sample(t, step=3)) for key, t in tensors.items()}, DENSITY)
    assert max(shares.values()) < 1.5


@pytest.mark.parametrize("sampled, density", [
    ({"only": (BIG, torch.rand(10_000))}, DENSITY),  # one tensor: nothing to share
    ({"a": (BIG, torch.zeros(10_000)), "b": (SMALL, torch.zeros(256))}, DENSITY),  # nothing to rank
    ({"a": (BIG, torch.rand(10_000)), "b": (SMALL, torch.rand(256))}, 0.0),  # nothing to keep
    ({"a": (BIG, torch.rand(10_000)), "b": (SMALL, torch.tensor([1.0, float("inf")]))}, DENSITY),  # no histogram
])
def test_with_nothing_to_compare_every_share_is_one(sampled, density):
    assert set(density_shares(sampled, density).values()) == {1.0}


SPEC = "adaptive+residual+rice+fp32"
SEGMENTS = [Segment("output", 0, BIG), Segment("hidden", BIG, SMALL)]


def step_counts(pipe: sc.Pipeline, step: int) -> dict[str, int]:
    buffer = torch.cat([normal(BIG, 1.0, 2 * step), normal(SMALL, 3.0, 2 * step + 1)])
    pipe.step(buffer, "bucket", segments=SEGMENTS, density=DENSITY)
    counts = {segment.key: pipe.states[segment.key].last.selected for segment in SEGMENTS}
    share_density(pipe)  # the reducer, as the step ends
    return counts


def test_a_pipeline_selects_by_the_shares_from_the_step_after_and_a_checkpoint_keeps_them():
    pipe = sc.Pipeline(SPEC)
    first = step_counts(pipe, 0)
    assert first["hidden"] == pytest.approx(DENSITY * SMALL, rel=0.5)  # no shares yet: the plan's density
    second = step_counts(pipe, 1)
    assert second["hidden"] > 5 * DENSITY * SMALL
    assert second["output"] == pytest.approx(DENSITY * BIG, rel=0.5)
    resumed = sc.Pipeline(SPEC)
    resumed.load_state_dict(pipe.state_dict())
    assert resumed.states["hidden"].density_share == pipe.states["hidden"].density_share > 5
    assert step_counts(resumed, 2) == step_counts(pipe, 2)


def test_the_budget_counts_bytes_per_entry_its_density_budgets_so_the_extra_entries_are_paid_for():
    plan = Planner(Adaptive(), world_size=2)
    plan.begin_step(now=0.0)
    measuring = plan.measuring
    measuring.payload_bytes, measuring.payload_nnz, measuring.whole_nnz = 3000, 1100, 100
    measuring.planned_nnz = 500  # the tensors sent twice the entries the density budgeted
    per_nnz = 3000 / 1100
    assert plan.end_step().bytes_per_nnz == pytest.approx(per_nnz * 1000 / 500)
