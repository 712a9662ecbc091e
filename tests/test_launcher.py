"""The local launcher: a failing or dying worker is named with its traceback, the others are stopped
soon after, and results arrive by value."""

import os
import time

import pytest
import torch

from sparsecomm.launch import WorkerError, run_local


def test_a_failing_worker_reports_its_rank_and_traceback():
    with pytest.raises(WorkerError, match="rank 1"):
        run_local(2, _fail_on_rank_one)


def test_a_failed_worker_does_not_leave_the_others_running_until_the_timeout():
    # rank 1 raises while rank 0 is busy for another minute: run_local stops it after a short grace
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank one fails"):
        run_local(2, _fail_on_rank_one_while_rank_zero_works, timeout=600)
    assert time.monotonic() - start < 40


def test_a_worker_that_dies_without_reporting_is_named_and_the_others_stopped():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1: exited with code 3"):
        run_local(2, _die_on_rank_one_while_rank_zero_works, timeout=600)
    assert time.monotonic() - start < 40


def test_worker_results_are_copies_that_outlive_the_worker():
    # A tensor passed through torch's shared-memory pickler lives in a file descriptor of the worker;
    # if the worker exits first, reading it fails. Results must arrive by value instead.
    results = run_local(2, _return_a_tensor)
    for rank, tensor in enumerate(results):
        assert not tensor.is_shared()
        torch.testing.assert_close(tensor, torch.arange(1000, dtype=torch.float32) + rank)


def _fail_on_rank_one_while_rank_zero_works(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails")
    time.sleep(60)


def _die_on_rank_one_while_rank_zero_works(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def _return_a_tensor(rank: int, world: int) -> torch.Tensor:
    return torch.arange(1000, dtype=torch.float32) + rank


def _fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("boom")
