"""The planned density shared out over a step's tensors (`sparsecomm.sparsify.shared_threshold`)."""

from __future__ import annotations

from sparsecomm.pipeline import Pipeline
from sparsecomm.sparsify.shared_threshold import density_shares


def share_density(pipeline: Pipeline) -> None:
    """At the end of a step with a planned density: each tensor sampled in it gets its share of
    the next step's density."""
    states = pipeline.states
    sampled = {key: (state.last.numel if state.last is not None else 0, state.magnitudes)
               for key, state in states.items() if state.magnitudes is not None}
    if not sampled:
        return
    density = min(density for _, (density, _) in sampled.values())
    shares = density_shares({key: (numel, sample) for key, (numel, (_, sample)) in sampled.items()}, density)
    for key, share in shares.items():
        states[key].density_share = share
        states[key].magnitudes = None
