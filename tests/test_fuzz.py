"""The fuzz harness: it mutates every codec pair's payloads in every way it knows, finds nothing on
today's decoders in a short bounded pass, and reports a planted bug with a reproducer that
reproduces it. (The note of each release reports a run of a million inputs or more.)"""

import json

import pytest

import sparsecomm as sc
from sparsecomm import fuzz
from sparsecomm.cli.main import main
from sparsecomm.encode.value.floats import Float32Values


def test_a_short_pass_exercises_every_mutation_and_finds_nothing():
    report = fuzz.fuzz(inputs=3000, seed=11)
    assert report.inputs == 3000
    assert set(report.by_mutation) == set(fuzz.MUTATIONS)
    assert report.outcomes["decoded"] > 100 and report.outcomes["PayloadError"] > 1000
    assert report.findings == [], report.findings[0]["problem"]


def test_the_corpus_covers_every_registered_codec():
    pairs = fuzz.codec_pairs()
    assert {sc.INDEX_CODECS.parse(index).name for index, _ in pairs} == set(sc.INDEX_CODECS.names())
    assert {sc.VALUE_CODECS.parse(value).name for _, value in pairs} == set(sc.VALUE_CODECS.names())


def test_a_planted_crash_is_reported_with_a_reproducer(monkeypatch):
    original = Float32Values.decode

    def fragile(self, data, nnz, dtype):
        if nnz == 3:
            raise RuntimeError("planted")
        return original(self, data, nnz, dtype)

    monkeypatch.setattr(Float32Values, "decode", fragile)
    report = fuzz.fuzz(inputs=2000, seed=12)
    crashes = [f for f in report.findings if f["outcome"] == "crash: RuntimeError"]
    assert crashes and "planted" in crashes[0]["problem"]
    with pytest.raises(RuntimeError, match="planted"):
        sc.decode(bytes.fromhex(crashes[0]["payload_hex"]), expect=crashes[0]["expect"])


def test_the_command_writes_its_report_and_fails_only_on_findings(tmp_path, capsys):
    path = tmp_path / "fuzz.json"
    assert main(["fuzz", "--inputs", "400", "--seed", "3", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["inputs"] == 400 and sum(report["outcomes"].values()) == 400 and report["findings"] == []
    assert "0 finding(s)" in capsys.readouterr().out
