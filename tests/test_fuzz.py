"""The fuzz harness: it mutates every codec pair's payloads in every way it knows, finds nothing on
today's decoders in a short bounded pass, and reports a planted bug with a reproducer that
reproduces it. (The note of each release reports a run of a million inputs or more.)"""

import json
import warnings

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


FOUND = {
    # seed 1126, a section_bytes mutation: an int8 scale of float32's largest value; level × (scale / 127)
    # rounded past it and decoded to Inf (numpy warned of the overflow)
    "int8 scale of float32's largest": "5350434d020201022c0100000000000003000000000000000c041800000000000000070000"
                                       "000000000014000000000000000f0000000000000072617728626974733d363429696e74385b"
                                       "00000000000000bb00000000000000ea00000000000000ffff7f7f04c9817db6d51c",
}


@pytest.mark.parametrize("finding", FOUND)
def test_what_the_fuzzer_found_decodes_cleanly_now(finding):
    payload = bytes.fromhex(FOUND[finding])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fuzz.check_decoded(sc.decode(payload), payload) is None


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
