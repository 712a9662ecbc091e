"""``sparsecomm bench collectives`` and ``sparsecomm calibrate``; the shaped network where allowed."""

import json
import time

import pytest
import torch
import torch.distributed as dist

import sparsecomm as sc
from sparsecomm.cli.main import main
from sparsecomm.launch import run_local
from sparsecomm.netns import ShapedNetwork
from sparsecomm.transport.cost_model import load_cost_model
from sparsecomm.transport.request import PHASES

ROW_FIELDS = {"transport", "algorithm", "workers", "numel", "density", "ms", "dense_ms", "allgather_ms", "bound_ms",
              "exact"}


def test_bench_collectives_reports_every_transport_with_the_documented_fields(tmp_path, capsys):
    out = tmp_path / "collectives.json"
    assert main(["bench", "collectives", "--workers", "2", "--numel", "40000", "--density", "0.01", "--repeat", "1",
                 "--json", str(out)]) == 0
    assert "ratio_to_bound" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert all(row.keys() >= ROW_FIELDS for row in rows)
    by_transport = {row["transport"]: row for row in rows}
    assert set(by_transport) >= {"dense", "allgather", "sparse_allreduce(algorithm=ssar_rd)", "sketch_allreduce",
                                 "auto", "sparse_allreduce(algorithm=dsar_sa,qsgd_bits=4)"}
    for text in ("dense", "allgather", "auto", "sparse_allreduce(algorithm=ssar_sa)"):
        assert by_transport[text]["exact"], text
    assert not by_transport["sketch_allreduce"]["exact"]
    assert by_transport["auto"]["algorithm"]  # says what it chose
    assert all(row["bound_ms"] > 0 and row["dense_ms"] == by_transport["dense"]["ms"] for row in rows)
    # one round of all, then up to 19 more of the close contenders and auto
    assert by_transport["auto"]["samples"] == 20 and {row["samples"] for row in rows} <= {1, 20}
    # the floor's output pass is timed in every round, beside the calls
    assert {row["output_pass_samples"] for row in rows} == {20}


def test_profile_times_each_phase_and_the_floor_states_its_parts(tmp_path, capsys):
    out = tmp_path / "profile.json"
    transports = ["allgather", "sparse_allreduce(algorithm=ssar_sa)", "sparse_allreduce(algorithm=ssar_rd)",
                  "sketch_allreduce", "auto"]
    argv = ["bench", "collectives", "--workers", "2", "--numel", "200000", "--density", "0.01", "--repeat", "2",
            "--profile", "--json", str(out)]
    assert main(argv + [arg for text in transports for arg in ("--transport", text)]) == 0
    printed = capsys.readouterr().out
    assert "per phase" in printed and "transfer" in printed
    for row in json.loads(out.read_text())["rows"]:
        phases = row["phases_ms"]
        assert set(phases) == set(PHASES)
        # a phase of the slowest rank never outlasts the slowest rank's whole call
        assert all(0 <= ms <= row["ms"] * 1.0001 for ms in phases.values()), row["transport"]
        assert phases["transfer"] + phases["agreement"] > 0, row["transport"]  # every call communicates
        parts = row["bound_latency_ms"] + row["bound_wire_ms"] + row["bound_output_ms"]
        assert row["bound_ms"] == pytest.approx(parts) and row["bound_output_ms"] > 0
        assert row["split_bound_ms"] > row["bound_output_ms"]
    by_transport = {row["transport"]: row for row in json.loads(out.read_text())["rows"]}
    assert by_transport["allgather"]["phases_ms"]["decode"] > 0
    assert by_transport["sparse_allreduce(algorithm=ssar_sa)"]["phases_ms"]["sum"] > 0


def test_close_contenders_and_auto_get_extra_rounds_within_a_budget():
    from sparsecomm.bench.collectives_bench import close_contenders, extra_rounds

    built = {text: sc.parse_spec(text).transport for text in ("dense", "allgather", "sparse_allreduce", "auto")}
    medians = {"dense": 500.0, "allgather": 10.0, "sparse_allreduce": 19.0, "auto": 30.0}
    contenders = close_contenders(medians, built)
    assert contenders == ["allgather", "sparse_allreduce", "auto"]  # within 2x of 10 ms, and auto
    samples = {text: [ms] * 15 for text, ms in medians.items()}
    assert extra_rounds(contenders, samples, 15) == 169  # 59 ms a round: 169 more fit in 10 s
    assert extra_rounds(contenders, samples, 5) == 95  # up to 20x5 rounds in all
    assert extra_rounds(["dense"], samples, 15) == 20  # 0.5 s a round: 20 more fit


def test_calibrate_saves_a_model_that_auto_then_loads(tmp_path, capsys):
    path = tmp_path / "model.json"
    assert main(["calibrate", "--workers", "2", "--output", str(path)]) == 0
    model = load_cost_model(path)
    assert model.alpha > 0 and model.beta > 0 and model.codec_per_nnz > 0 and model.source == str(path)
    assert "saved to" in capsys.readouterr().out


def test_a_bad_transport_spec_fails_before_starting_workers(capsys):
    assert main(["bench", "collectives", "--transport", "sparse_allreduce(algorithm=magic)", "--numel", "100"]) == 2
    assert "algorithm must be one of" in capsys.readouterr().err


def _timed_allreduce(rank: int, world: int, numel: int) -> float:
    tensor = torch.ones(numel)
    dist.all_reduce(tensor)
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor)
    return time.perf_counter() - start


@pytest.mark.skipif(not ShapedNetwork.available()[0], reason=f"no shaped network here: {ShapedNetwork.available()[1]}")
def test_a_shaped_link_really_limits_the_rate():
    numel = 1 << 20  # 4 MiB: a 2-rank ring all_reduce sends 4 MiB each way
    with ShapedNetwork(2, "100mbit") as network:
        seconds = max(run_local(2, _timed_allreduce, numel, namespaces=network.namespaces, timeout=120))
        namespaces = list(network.namespaces)
    assert seconds >= 4 * numel / 12.5e6 * 0.8  # at 100 Mbit/s that is at least ~0.34 s
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in namespaces)  # cleaned up


def _one_way_seconds(rank: int, world: int, nbytes: int) -> float:
    """Median time to send ``nbytes`` from rank 0 to rank 1 and get a 4-byte answer, the link idle before."""
    message, answer, times = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(1), []
    for _ in range(5):
        dist.barrier()
        time.sleep(0.05)  # long enough for any token bucket to refill
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, 1)
            dist.recv(answer, 1)
        else:
            dist.recv(message, 0)
            dist.send(answer, 0)
        times.append(time.perf_counter() - start)
    return sorted(times)[2]


def test_link_bursts_hold_a_quarter_millisecond_of_line_time_and_at_least_16_kb():
    from sparsecomm.netns import link_burst

    assert link_burst("100mbit") == "16384" and link_burst("1gbit") == "32000" and link_burst("10gbit") == "320000"


@pytest.mark.skipif(not ShapedNetwork.available()[0], reason=f"no shaped network here: {ShapedNetwork.available()[1]}")
def test_a_message_smaller_than_the_old_burst_still_pays_its_wire_time():
    # 200 kB at 100 Mbit/s: 16 ms of wire; a 256 KB token bucket let it through in 1.4 ms
    with ShapedNetwork(2, "100mbit") as network:
        seconds = run_local(2, _one_way_seconds, 200_000, namespaces=network.namespaces, timeout=120)[0]
    assert seconds >= 0.8 * 200_000 * 8 / 100e6


def stalled_ping_pongs(rank: int, world: int) -> float:
    """Rank 1 answers every other ping 20 ms late, as a thread kept from a busy processor would."""
    from sparsecomm.bench import calibration

    original, answered = dist.send, [0]

    def late_send(tensor, dst, *args, **kwargs):
        answered[0] += 1
        if rank == 1 and answered[0] % 2 == 0:
            time.sleep(0.020)
        return original(tensor, dst, *args, **kwargs)

    dist.send = late_send
    try:
        return calibration.one_way_seconds(rank, 8, repeat=6)
    finally:
        dist.send = original


def test_the_link_latency_is_the_least_ping_pong_not_one_that_stalled():
    alpha = run_local(2, stalled_ping_pongs)[0]
    assert 0 < alpha < 0.005  # the median of these samples: 5 ms or more
