"""Shared fixtures."""

import numpy as np
import pytest
import torch


@pytest.fixture
def global_rng_untouched():
    """Fails the test if it changed torch's or numpy's global RNG state."""
    torch_state = torch.random.get_rng_state().clone()
    numpy_state = np.random.get_state()[1].copy()  # noqa: NPY002 (reading the legacy global state is the point)
    yield
    assert torch.equal(torch.random.get_rng_state(), torch_state), "torch global RNG was used"
    assert np.array_equal(np.random.get_state()[1], numpy_state)  # noqa: NPY002, "numpy global RNG was used"
