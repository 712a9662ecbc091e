"""Structure-aware fuzzing of `decode`: valid payloads of every registered codec pair (every Bloom
policy too), mutated where a decoder is most likely to trust what it reads — header fields, the
codec parameters named in the payload, section bytes and section lengths — with the checksum
recomputed so that the mutation reaches the codec's own checks. Anything but a clean decode or a
`PayloadError`, any decode slower than ``slow_s`` and any that raises the process's peak memory by
more than ``memory_mb``, is a finding, kept with its reproducer.

A clean decode must also be a valid gradient: the header's shape and nnz, indices strictly
increasing inside the tensor, finite values.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
import resource
import struct
import time
import traceback
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from sparsecomm.encode.base import INDEX_CODECS, VALUE_CODECS
from sparsecomm.errors import PayloadError
from sparsecomm.payload import _CRC, _HEADER, decode, encode, read_info
from sparsecomm.sparse_gradient import SparseGradient

INTERESTING = (0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 1023, 1024, 65535, 65536,
               2**24, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**48, 2**63 - 1, 2**63, 2**64 - 1)
"""values a mutated integer field takes: small counts, powers of two and their neighbours, type limits"""
INTERESTING_PARAMS = ("0", "1", "2", "-1", "0.5", "1e-12", "0.999999", "1e9", "255", "256", "65536", "16777216",
                      "4294967296", "true", "false", "nan", "p0", "p2", "naive", "x")
MUTATIONS = ("section_bytes", "section_length", "header_field", "codec_parameter", "codec_name", "raw_bytes")
_HEADER_FIELDS = ("magic", "version", "flags", "dtype", "ndim", "numel", "nnz", "index_spec_len", "value_spec_len",
                  "index_bytes", "value_bytes")


@dataclass(frozen=True)
class PayloadParts:
    """A payload cut into the parts a mutation changes. `assemble` puts any such parts back
    together, with the lengths taken from the parts and the checksum recomputed."""

    fields: dict[str, Any]
    """the fixed header's fields by name (lengths among them are recomputed by `assemble`)"""
    shape: bytes
    index_text: str
    value_text: str
    index_section: bytes
    value_section: bytes

    @classmethod
    def parse(cls, payload: bytes) -> PayloadParts:
        fields = dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(payload), strict=True))
        shape_end = _HEADER.size + 8 * fields["ndim"]
        index_text_end = shape_end + fields["index_spec_len"]
        text_end = index_text_end + fields["value_spec_len"]
        index_end = text_end + fields["index_bytes"]
        return cls(fields, payload[_HEADER.size:shape_end], payload[shape_end:index_text_end].decode(),
                   payload[index_text_end:text_end].decode(), payload[text_end:index_end],
                   payload[index_end:-_CRC.size])

    def assemble(self) -> bytes:
        index_spec, value_spec = self.index_text.encode()[:255], self.value_text.encode()[:255]
        values = dict(self.fields, index_spec_len=len(index_spec), value_spec_len=len(value_spec),
                      index_bytes=len(self.index_section), value_bytes=len(self.value_section))
        values = {name: value & ((1 << 8 * _field_size(name)) - 1) if isinstance(value, int) else value
                  for name, value in values.items()}
        body = _HEADER.pack(*[values[name] for name in _HEADER_FIELDS]) + self.shape + index_spec + value_spec
        body += self.index_section + self.value_section
        return body + _CRC.pack(zlib.crc32(body))


@dataclass(frozen=True)
class Seed:
    """A valid payload, its parts, and the tensor size its receiver expects."""

    payload: bytes
    parts: PayloadParts
    numel: int


@dataclass
class FuzzReport:
    """What one fuzzing run saw."""

    inputs: int = 0
    seconds: float = 0.0
    outcomes: Counter = field(default_factory=Counter)
    by_mutation: dict[str, Counter] = field(default_factory=dict)
    slowest_s: float = 0.0
    findings: list[dict[str, Any]] = field(default_factory=list)

    def merge(self, other: FuzzReport) -> None:
        self.inputs += other.inputs
        self.seconds = max(self.seconds, other.seconds)
        self.outcomes.update(other.outcomes)
        for kind, counts in other.by_mutation.items():
            self.by_mutation.setdefault(kind, Counter()).update(counts)
        self.slowest_s = max(self.slowest_s, other.slowest_s)
        self.findings.extend(other.findings)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["outcomes"] = dict(self.outcomes)
        out["by_mutation"] = {kind: dict(counts) for kind, counts in self.by_mutation.items()}
        out["inputs_per_s"] = self.inputs / self.seconds if self.seconds else 0.0
        return out


def codec_pairs() -> list[tuple[str, str]]:
    """Every registered index codec (each Bloom policy, raw at 64 bits) with every value codec it
    takes, plus non-default parameters that change the wire format."""
    index_names = [name for name in INDEX_CODECS.names() if name != "bloom"]
    index_names += ["raw(bits=64)", "rice(parameter=0)", "skcompress(coder=ans,keys=rice)"]
    index_names += [f"bloom(policy={policy})" for policy in ("naive", "leftmost", "p0", "p1", "p2")]
    value_names = VALUE_CODECS.names() + ["qsgd(bits=2,bucket=4)", "deflate(shuffle=false)", "polyfit(degree=2)"]
    return [(index, value) for index in index_names for value in value_names
            if not INDEX_CODECS.parse(index).codes_values or value == "fp32"]


def seed_corpus(seed: int = 0) -> list[Seed]:
    """Valid payloads of every codec pair at a few sizes and densities (empty, one, sparse, dense,
    and sparse with a run of 400 indices, which a lossless index codec sends as a runs block)."""
    rng = np.random.default_rng(seed)
    corpus = []
    for index, value in codec_pairs():
        for numel, scattered, run in ((1, 1, 0), (64, 0, 0), (300, 3, 0), (2000, 120, 0), (2000, 1500, 0),
                                      (2000, 40, 400)):
            chosen = np.union1d(rng.choice(numel, size=scattered, replace=False), np.arange(500, 500 + run))
            indices = torch.from_numpy(chosen.astype(np.int64))
            nnz = indices.numel()
            values = torch.from_numpy(rng.standard_normal(nnz).astype(np.float32))
            shape = (numel,) if numel % 20 else (20, numel // 20)
            grad = SparseGradient(indices, values, torch.Size(shape))
            payload = encode(grad, index, value, rng=rng, dense=grad.to_dense())
            corpus.append(Seed(payload, PayloadParts.parse(payload), numel))
    return corpus


def mutate(seed: Seed, rng: np.random.Generator) -> tuple[str, bytes]:
    """(the mutation's kind, a mutated payload) — checksummed, except for ``raw_bytes``."""
    kind = MUTATIONS[int(rng.integers(len(MUTATIONS)))]
    if kind == "raw_bytes":
        data = bytearray(seed.payload)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(len(data)))] = int(rng.integers(256))
        return kind, bytes(data[: int(rng.integers(len(data) + 1))] if rng.random() < 0.3 else data)
    parts = seed.parts
    if kind == "section_bytes":
        if rng.random() < 0.5:
            parts = replace(parts, index_section=_mutate_bytes(parts.index_section, rng))
        else:
            parts = replace(parts, value_section=_mutate_bytes(parts.value_section, rng))
    elif kind == "section_length":  # bytes added or cut, the header kept consistent
        if rng.random() < 0.5:
            parts = replace(parts, index_section=_resize(parts.index_section, rng))
        else:
            parts = replace(parts, value_section=_resize(parts.value_section, rng))
    elif kind == "header_field":
        name = ["numel", "nnz", "flags", "dtype", "ndim"][int(rng.integers(5))]
        fields = dict(parts.fields, **{name: _interesting(rng, name)})
        shape = parts.shape
        if name == "numel" and fields["ndim"] == 1 and rng.random() < 0.7:  # keep shape and numel consistent
            shape = struct.pack("<Q", fields["numel"])
        parts = replace(parts, fields=fields, shape=shape)
    elif kind == "codec_parameter":
        if rng.random() < 0.5:
            parts = replace(parts, index_text=_mutate_parameters(parts.index_text, INDEX_CODECS, rng))
        else:
            parts = replace(parts, value_text=_mutate_parameters(parts.value_text, VALUE_CODECS, rng))
    else:  # codec_name: another registered codec reads these bytes
        if rng.random() < 0.5:
            parts = replace(parts, index_text=INDEX_CODECS.names()[int(rng.integers(len(INDEX_CODECS.names())))])
        else:
            parts = replace(parts, value_text=VALUE_CODECS.names()[int(rng.integers(len(VALUE_CODECS.names())))])
    return kind, parts.assemble()


def check_decoded(grad: SparseGradient, payload: bytes) -> str | None:
    """Why a clean decode is not a valid gradient of what the header says, or None."""
    info = read_info(payload)
    if tuple(grad.shape) != tuple(info.shape) or grad.nnz != info.nnz:
        return "decoded gradient does not match its header"
    indices = grad.indices
    increasing = bool((indices[1:] > indices[:-1]).all())
    if grad.nnz and (int(indices[0]) < 0 or int(indices[-1]) >= info.numel or not increasing):
        return "decoded indices are not strictly increasing inside the tensor"
    if not bool(torch.isfinite(grad.values).all()):
        return "decoded values are not finite"
    return None


def fuzz(seconds: float | None = None, inputs: int | None = None, seed: int = 0, slow_s: float = 1.0,
         memory_mb: float = 32.0) -> FuzzReport:
    """Fuzz for ``seconds`` or ``inputs`` (whichever ends first) in this process."""
    corpus = seed_corpus(seed)
    rng = np.random.default_rng([seed, 1])
    report = FuzzReport()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy warning marks a value no check stopped: a finding too
        _fuzz_loop(corpus, rng, report, start, seconds, inputs, slow_s, memory_mb, _peak_rss_mb())
    report.seconds = time.perf_counter() - start
    return report


def _fuzz_loop(corpus: list[Seed], rng: np.random.Generator, report: FuzzReport, start: float,
               seconds: float | None, inputs: int | None, slow_s: float, memory_mb: float,
               baseline_rss: float) -> None:
    while (inputs is None or report.inputs < inputs) and (seconds is None or time.perf_counter() - start < seconds):
        original = corpus[int(rng.integers(len(corpus)))]
        kind, payload = mutate(original, rng)
        expect = original.numel if rng.random() < 0.5 else None
        began = time.perf_counter()
        problem = None
        try:
            outcome = "decoded"
            problem = check_decoded(decode(payload, expect=expect), payload)
        except PayloadError:
            outcome = "PayloadError"
        except Exception as err:  # noqa: BLE001 - every other exception is a finding
            outcome, problem = f"crash: {type(err).__name__}", "".join(traceback.format_exception(err))[-2000:]
        elapsed = time.perf_counter() - began
        if problem is not None and outcome == "decoded":
            outcome = "invalid decode"
        if elapsed > slow_s:
            outcome, problem = f"slow ({outcome})", problem or f"decode took {elapsed:.2f} s"
        grown = _peak_rss_mb() - baseline_rss
        if grown > memory_mb:
            outcome, problem = f"memory ({outcome})", problem or f"peak memory grew by {grown:.0f} MB"
            baseline_rss += grown  # report each new peak once
        report.inputs += 1
        report.outcomes[outcome] += 1
        report.by_mutation.setdefault(kind, Counter())[outcome] += 1
        report.slowest_s = max(report.slowest_s, elapsed)
        if problem is not None:
            report.findings.append({"outcome": outcome, "mutation": kind, "expect": expect, "seconds": elapsed,
                                    "problem": problem, "payload_hex": payload.hex()})


def fuzz_parallel(workers: int, seconds: float | None, inputs: int | None, seed: int = 0,
                  slow_s: float = 1.0, memory_mb: float = 32.0) -> FuzzReport:
    """`fuzz` in ``workers`` processes, each with its own mutation stream."""
    if workers == 1:
        return fuzz(seconds, inputs, seed, slow_s, memory_mb)
    share = None if inputs is None else -(-inputs // workers)
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers) as pool:
        parts = pool.starmap(fuzz, [(seconds, share, seed + worker, slow_s, memory_mb) for worker in range(workers)])
    report = FuzzReport()
    for part in parts:
        report.merge(part)
    return report


# -- helpers ----------------------------------------------------------------------------------------
def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _field_size(name: str) -> int:
    return {"magic": 4, "numel": 8, "nnz": 8, "index_bytes": 8, "value_bytes": 8}.get(name, 1)


def _interesting(rng: np.random.Generator, name: str) -> int:
    value = INTERESTING[int(rng.integers(len(INTERESTING)))]
    return value & ((1 << 8 * _field_size(name)) - 1)


def _mutate_bytes(section: bytes, rng: np.random.Generator) -> bytes:
    if not section:
        return bytes(rng.integers(0, 256, size=int(rng.integers(1, 9)), dtype=np.uint8))
    data = bytearray(section)
    for _ in range(int(rng.integers(1, 5))):
        position = int(rng.integers(len(data)))
        choice = rng.random()
        if choice < 0.4:
            data[position] ^= 1 << int(rng.integers(8))
        elif choice < 0.7:
            data[position] = int(rng.integers(256))
        else:  # an interesting little-endian integer written over a field-sized run
            width = [1, 2, 4, 8][int(rng.integers(4))]
            value = INTERESTING[int(rng.integers(len(INTERESTING)))] & ((1 << 8 * width) - 1)
            data[position:position + width] = value.to_bytes(width, "little")[: len(data) - position]
    return bytes(data)


def _resize(section: bytes, rng: np.random.Generator) -> bytes:
    if section and rng.random() < 0.5:
        return section[: int(rng.integers(len(section)))]
    extra = bytes(rng.integers(0, 256, size=int(rng.integers(1, 64)), dtype=np.uint8))
    position = int(rng.integers(len(section) + 1))
    return section[:position] + extra + section[position:]


def _mutate_parameters(text: str, registry: Any, rng: np.random.Generator) -> str:
    """The codec text with one parameter set to an interesting value (added if absent)."""
    name = re.match(r"\w+", text)
    if name is None or name.group(0) not in registry:
        return text
    parameters = [f.name for f in dataclasses.fields(registry.get(name.group(0)))]
    if not parameters:
        return text + "(x=1)"
    chosen = parameters[int(rng.integers(len(parameters)))]
    value = INTERESTING_PARAMS[int(rng.integers(len(INTERESTING_PARAMS)))]
    existing = dict(re.findall(r"(\w+)=([^,)]*)", text))
    existing[chosen] = value
    return f"{name.group(0)}({','.join(f'{k}={v}' for k, v in existing.items())})"
