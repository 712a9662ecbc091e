"""The command line: tables on stdout, JSON with the documented fields, clear errors."""

import json

import numpy as np
import pytest

from sparsecomm.cli.main import main

CODEC_FIELDS = {"index_codec", "value_codec", "numel", "nnz", "index_bits_per_nnz", "value_bits_per_nnz",
                "bound_bits_per_nnz", "encode_ms", "decode_ms", "max_abs_error", "lossless"}


def test_bench_codecs_writes_a_table_and_json(tmp_path, capsys):
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--numel", "20000", "--density", "0.01,0.1", "--source", "normal",
                 "--repeat", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "index_bits_per_nnz" in table and "rice" in table
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert all(row.keys() >= CODEC_FIELDS for row in rows)
    assert {r["index_codec"] for r in rows} >= {"raw", "bitmap", "rle", "delta_binary", "huffman", "rice"}
    assert {r["value_codec"] for r in rows} >= {"fp32", "fp16", "bf16", "qsgd", "deflate"}
    by_pair = {(r["density"], r["index_codec"], r["value_codec"]): r for r in rows}
    rice = by_pair[(0.01, "rice", "fp32")]
    assert rice["lossless"] and rice["max_abs_error"] == 0.0 and rice["nnz"] == 200
    assert rice["bound_bits_per_nnz"] <= rice["index_bits_per_nnz"] < 1.1 * rice["bound_bits_per_nnz"]
    assert by_pair[(0.01, "raw", "fp16")]["index_bits_per_nnz"] == pytest.approx(32.0)
    assert by_pair[(0.1, "bitmap", "fp16")]["index_bits_per_nnz"] == pytest.approx(10.0)
    assert not by_pair[(0.01, "rice", "qsgd")]["lossless"]
    assert result["machine"]["torch"]


def test_bench_codecs_deepreduce_suite_reports_volume_time_and_error(tmp_path, capsys):
    out, picture = tmp_path / "dr.json", tmp_path / "dr.png"
    assert main(["bench", "codecs", "--suite", "deepreduce", "--numel", "36864", "--density", "0.01",
                 "--source", "laplace", "--repeat", "1", "--json", str(out), "--plot", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "grad_rel_l2_error" in capsys.readouterr().out
    rows = {(r["index_codec"], r["value_codec"]): r for r in json.loads(out.read_text())["rows"]}
    top_k = rows[("raw", "fp32")]
    p0 = rows[("bloom(policy=p0)", "fp32")]
    assert p0["decoded_nnz"] > p0["nnz"] and p0["grad_rel_l2_error"] <= top_k["grad_rel_l2_error"]
    p2_fit = rows[("bloom", "polyfit")]
    assert p2_fit["payload_bytes"] < 0.6 * top_k["payload_bytes"] and p2_fit["rel_l2_error"] < 0.3
    assert rows[("bloom(policy=naive)", "fp32")]["rel_l2_error"] > 1.0  # misaligned values
    assert rows[("rice", "fp32")]["index_bits_per_nnz"] < rows[("bloom", "fp32")]["index_bits_per_nnz"]


def test_bench_codecs_reads_a_saved_gradient(tmp_path, capsys):
    path = tmp_path / "grad.npy"
    np.save(path, np.linspace(-1, 1, 5000, dtype=np.float32).reshape(50, 100))
    out = tmp_path / "r.json"
    assert main(["bench", "codecs", "--source", str(path), "--density", "0.02", "--repeat", "1",
                 "--pair", "rice/fp32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["numel"] == 5000 and rows[0]["nnz"] == 100 and rows[0]["lossless"]


def test_bench_sparsify_json_has_run_and_row_fields(tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "sparsify", "--numel", "200000", "--density", "0.01", "--source", "laplace",
                 "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["topk_ms"] > 0 and result["pass_ms"] > 0
    names = [row["sparsifier"].split("(")[0] for row in result["rows"]]
    assert names == ["topk", "dgc", "randomk", "threshold", "block_topk", "bucketed_topk"]
    for row in result["rows"]:
        assert {"sparsifier", "ms", "selected", "target"} <= row.keys()
    topk_row = result["rows"][0]
    assert topk_row["selected"] == topk_row["target"] == 2000


def test_bench_ddp_step_times_each_preset_next_to_ddps_allreduce(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "ddp-step", "--numel", "300000", "--presets", "dense,dgc", "--repeat", "2",
                 "--json", str(out)]) == 0
    assert "vs_allreduce" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["backend"] == "gloo"
    assert [row["preset"] for row in result["rows"]] == ["ddp-allreduce", "dense", "dgc"]
    assert 300_000 <= result["parameters"] < 300_000 + 2048 * 2049  # whole layers of 2048
    assert result["rows"][0]["vs_allreduce"] == 1.0
    assert all(row["ms"] > 0 for row in result["rows"])


def test_bench_ddp_step_counts_each_rows_ops_and_host_syncs_per_step(tmp_path, capsys):
    out = tmp_path / "count.json"
    assert main(["bench", "ddp-step", "--numel", "99840", "--width", "64", "--presets", "dgc",
                 "--baselines", "fp16", "--workers", "2", "--repeat", "3", "--count", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "syncs_per_step" in printed and "host_device_bytes_per_step" in printed
    result = json.loads(out.read_text())
    assert result["tensors"] == 2 * 24  # 24 layers of width 64: their weights and biases
    rows = {row["preset"]: row for row in result["rows"]}
    assert list(rows) == ["ddp-allreduce", "torch-fp16", "dgc"]
    assert rows["ddp-allreduce"]["syncs_per_step"] == 0  # DDP alone reads nothing back
    assert rows["dgc"]["syncs_per_step"] > 0
    assert all(row["ops_per_step"] > 0 for row in rows.values())
    assert rows["dgc"]["ops_per_step"] > rows["ddp-allreduce"]["ops_per_step"]
    assert all(row["host_device_bytes_per_step"] == 0 for row in rows.values())  # no device here


def test_benches_say_which_device_they_ran_on(tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "sparsify", "--numel", "50000", "--density", "0.01", "--repeat", "1", "--device", "cpu",
                 "--sparsifier", "dgc(ratio=0.01)", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["device"] == "cpu"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "codecs", "--pair", "rice", "--numel", "100"], "INDEX/VALUE"),
        (["bench", "codecs", "--pair", "rice/nope", "--numel", "100"], "unknown value 'nope'"),
        (["bench", "codecs", "--source", "missing.npy"], "no such gradient file"),
        (["bench", "sparsify", "--sparsifier", "topk(ratio=2)", "--numel", "100"], "ratio must be in"),
        (["bench", "sparsify", "--device", "gpu", "--numel", "100"], "unknown device 'gpu'"),
        (["bench", "ddp-step", "--presets", "dgc,bogus", "--numel", "2000"], "unknown component 'bogus'"),
        (["bench", "ddp-step", "--numel", "1000000", "--width", "64"], "needs more than the 64 layers"),
        (["bench", "collectives", "--codecs", "rice/nope", "--numel", "100"], "unknown value 'nope'"),
        (["calibrate", "--workers", "1"], "--workers must be at least 2"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    """Refused before any worker starts."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--workers", "2.9"], "must be a whole number"),
    (["train", "--steps", "inf"], "must be a whole number"),
    (["train", "--lr", "-0.1"], "must be a finite number > 0"),
    (["bench", "sparsify", "--numel", "x"], "not a number"),
])
def test_numbers_that_are_not_what_an_argument_takes_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_scaling_refuses_a_result_that_is_not_a_training_runs(tmp_path, capsys):
    other = tmp_path / "ddp_step.json"
    other.write_text(json.dumps({"benchmark": "ddp-step", "rows": []}))
    assert main(["scaling", "--from", str(other)]) == 2
    assert "is not a `sparsecomm train --json` result" in capsys.readouterr().err


def test_a_sparsifier_with_its_own_count_is_raced_against_topk_at_that_count(tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "sparsify", "--numel", "200000", "--density", "0.001", "--repeat", "1",
                 "--sparsifier", "topk(ratio=0.1)", "--sparsifier", "topk(ratio=0.001)", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    own, at_density = result["rows"]
    assert own["target"] == 20_000 and at_density["target"] == result["k"] == 200
    assert at_density["topk_ms"] == result["topk_ms"] and own["topk_ms"] != result["topk_ms"]
