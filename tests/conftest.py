"""Shared fixtures, and the test tiers.

Tiers, by marker: ``distributed`` tests start worker processes (`run_local`, the CLI's training and
collectives jobs), ``gpu`` tests need CUDA, ``slow`` ones are exhaustive sweeps of many seconds.
``pytest -m "not distributed and not gpu and not slow"`` is the unit tier. A test is marked
``distributed`` where its own code starts workers (see `STARTS_WORKERS`), and a test outside that
tier that starts a process anyway fails, so the tier stays what it says."""

import inspect
import multiprocessing.process

import numpy as np
import pytest
import torch

STARTS_WORKERS = ("run_local(", '"--workers"', '"ddp-step"', '"--nproc_per_node"', 'main(["train"',
                  "train_on_loopback(", "ShapedNetwork(", "train.runner import run")
"""what, in a test function's source, starts worker processes"""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "distributed: starts worker processes (local gloo ranks)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "slow: an exhaustive sweep taking many seconds on its own")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    starts_workers: dict[object, bool] = {}  # per test function: its parametrized items share it
    for item in items:
        function = getattr(item, "function", None)
        if function not in starts_workers:
            source = inspect.getsource(function) if function is not None else ""
            starts_workers[function] = any(starts in source for starts in STARTS_WORKERS)
        if starts_workers[function]:
            item.add_marker(pytest.mark.distributed)
        if any(mark.name == "skipif" and "CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers()):
            item.add_marker(pytest.mark.gpu)  # skipped where CUDA is missing: it needs a GPU


@pytest.fixture(autouse=True)
def _workers_only_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the ``distributed`` tier, starting a process fails the test."""
    if request.node.get_closest_marker("distributed") is None:
        def refuse(self: multiprocessing.process.BaseProcess) -> None:
            raise AssertionError("this test starts a worker process: its code should say so (STARTS_WORKERS)")

        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture
def global_rng_untouched():
    """Fails the test if it changed torch's or numpy's global RNG state."""
    torch_state = torch.random.get_rng_state().clone()
    numpy_state = np.random.get_state()[1].copy()  # noqa: NPY002 (reading the legacy global state is the point)
    yield
    assert torch.equal(torch.random.get_rng_state(), torch_state), "torch global RNG was used"
    assert np.array_equal(np.random.get_state()[1], numpy_state)  # noqa: NPY002, "numpy global RNG was used"
