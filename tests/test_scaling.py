"""The scaling projection: α-β formulas per way of travelling, anchored at a run's own steps, checked
against other runs, and the ``sparsecomm scaling`` command."""

import json

import pytest

from sparsecomm.cli.main import main
from sparsecomm.train.scaling import RowCosts, anchored, check, project

MB = 1e6


def row(name: str, kind: str, nbytes: float, **extra) -> RowCosts:
    return RowCosts(name, kind, compute_s=0.010, encode_s=0.0, decode_s=0.0, bytes_per_step=nbytes,
                    dense_bytes=100 * MB, measured_workers=2, **extra)


def test_an_allreduce_moves_twice_the_bytes_over_log_rounds_and_one_worker_only_computes():
    dense = row("dense", "allreduce", 100 * MB)
    assert dense.step_s(1, 1e9, 50e-6) == 0.010 and dense.speedup(1, 1e9, 50e-6) == 1.0
    # 8 workers on 1 Gbit/s: 2*3 latencies and 2*7/8 of 100 MB at 8 ns per byte
    assert dense.step_s(8, 1e9, 50e-6) == pytest.approx(0.010 + 6 * 50e-6 + 1.75 * 100 * MB * 8e-9)
    powersgd = row("powersgd", "allreduce", 1 * MB, collectives=3)
    assert powersgd.step_s(8, 1e9, 0) == pytest.approx(0.010 + 3 * 1.75 * MB * 8e-9)


def test_an_allgather_receives_every_other_payload_and_decodes_them():
    gathered = RowCosts("dgc", "allgather", 0.010, 0.001, 0.002, 1 * MB, 100 * MB, measured_workers=2)
    assert gathered.step_s(16, 10e9, 0) == pytest.approx(0.010 + 0.001 + 0.002 * 15 + 15 * MB * 0.8e-9)


def test_a_peeled_sketch_grows_with_the_ranks_selections():
    peeled = RowCosts("s2", "peeled_sketch", 0.010, 0.001, 0.002, 1 * MB, 100 * MB, measured_workers=2)
    # 16 workers: 8× the two-worker sketch and its decoding, all_reduced
    assert peeled.step_s(16, 10e9, 0) == pytest.approx(0.010 + 0.001 + 0.016 + 2 * 15 / 16 * 8 * MB * 0.8e-9)
    assert peeled.peeled_sketch(256)[1] == 128 * MB  # past dense: the transport does not cap it


def test_sparcmls_recursive_doubling_grows_with_the_union_and_stops_at_dense():
    sparse = row("sparcml", "sparse_allreduce", 1 * MB)  # density 1%
    two, many = sparse.step_s(2, 1e9, 0), sparse.step_s(256, 1e9, 0)
    assert two == pytest.approx(0.010 + 1 * MB * 8e-9)
    unions = sum(min(1 - 0.99 ** (2**t), 1.0) for t in range(8))
    assert many == pytest.approx(0.010 + unions * 100 * MB * 8e-9)


def test_adaptive_takes_its_cheapest_mode():
    adaptive = row("adaptive", "adaptive", 50 * MB, sparse_overhead_s=0.004, bytes_per_nnz=1.5)
    fast, slow = adaptive.step_s(8, 100e9, 0), adaptive.step_s(8, 100e6, 0)
    assert fast == pytest.approx(0.010 + 1.75 * 50 * MB * 0.08e-9)  # fp16 dense on 100 Gbit/s
    budget = 0.010 / (8 / 100e6) / 7  # what the link carries while the step computes, per peer
    assert slow == pytest.approx(0.010 + 0.002 * (1 + 7) + 7 * budget * 8 / 100e6)
    # the density its run preferred, where that is less: 0.01% of the 25M entries at 1.5 bytes each
    settled = row("adaptive", "adaptive", 50 * MB, sparse_overhead_s=0.004, bytes_per_nnz=1.5, sparse_density=0.0001)
    assert settled.step_s(8, 100e6, 0) == pytest.approx(0.010 + 0.002 * (1 + 7) + 7 * 3_750 * 8 / 100e6)
    assert settled.step_s(8, 100e9, 0) == pytest.approx(fast)  # where fp16 dense is cheaper still


def run(link: str, steps_s: dict[str, float], workers: int = 2) -> dict:
    """A train result whose rows took ``steps_s`` per step on ``link``."""
    rows = [{"preset": name, "steps": 10, "compute_s": 0.1, "encode_s": 0.0, "decode_s": 0.0, "workers": workers,
             "bytes_per_step": 4e5 if name == "dense" else 4e3} for name in steps_s]
    curves = {name: {"elapsed_s": [step * (i + 1) for i in range(10)]} for name, step in steps_s.items()}
    return {"benchmark": "train", "workload": "toy", "workers": workers, "link": link, "rows": rows, "curves": curves}


def test_rows_are_anchored_at_the_runs_own_steps_and_checked_against_other_runs():
    at_100mbit = run("100mbit", {"dense": 0.050, "dgc": 0.020})
    costs = {c.name: c for c in anchored(at_100mbit)}
    assert costs["dense"].step_s(2, 100e6, 50e-6) == pytest.approx(0.050)  # the anchor itself
    assert costs["dgc"].unmodeled_s == pytest.approx(0.020 - costs["dgc"].modeled_s(2, 100e6, 50e-6))
    at_1gbit = run("1gbit", {"dense": 0.010, "dgc": 0.015})
    checked = {r["preset"]: r for r in check(list(costs.values()), at_1gbit)}
    assert checked["dense"]["measured_ms"] == pytest.approx(10.0)
    assert checked["dense"]["error_pct"] == pytest.approx(100 * (checked["dense"]["projected_ms"] - 10) / 10)
    assert check(list(costs.values()), run("loopback", {"dense": 0.01})) == []  # no rate to compare at


def test_the_scaling_command_projects_a_saved_run_and_checks_it_against_another(tmp_path, capsys):
    base, other = tmp_path / "a.json", tmp_path / "b.json"
    base.write_text(json.dumps(run("100mbit", {"dense": 0.050, "dgc": 0.020})))
    other.write_text(json.dumps(run("1gbit", {"dense": 0.010, "dgc": 0.015})))
    out, picture = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["scaling", "--from", str(base), "--check", str(other), "--json", str(out),
                 "--plot", str(picture)]) == 0
    text = capsys.readouterr().out
    assert "1gbit P=256" in text and "against other runs" in text
    projection = json.loads(out.read_text())
    assert len(projection["points"]) == 2 * 3 * 9 and len(projection["check"]) == 2
    assert picture.read_bytes()[:4] == b"\x89PNG"
    assert project(json.loads(base.read_text()))["anchor"] == "100mbit"
    assert main(["scaling", "--from", str(tmp_path / "missing.json")]) == 2
