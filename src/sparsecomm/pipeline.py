"""`Pipeline`: one spec string's local stages (feedback → sparsify → encode) applied step after step,
with per-tensor state.

    pipe = Pipeline("topk(ratio=0.01)+residual+rice+fp16")
    payload = pipe.compress(grad, key="layer1.weight")   # bytes, self-describing
    received = sparsecomm.decode(payload)                # SparseGradient

Non-finite gradients are handled before anything enters residuals or momenta, by ``nonfinite``:
``"raise"`` (default) refuses the step, ``"skip"`` sends nothing from this tensor this step and
steps its state as with a zero gradient, ``"zero"`` replaces NaN/±Inf entries by 0 and goes on.

A step may cover several named tensors laid out in one flat buffer (a DDP bucket): each `Segment`
keeps its own state — residual, momentum, step — and is sparsified on its own, and the step sends
one payload for all of them. So state follows its tensor, whatever buffer it arrives in.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparsecomm.encode.base import codecs_lossless
from sparsecomm.errors import SparseCommError
from sparsecomm.feedback.base import state_dtype
from sparsecomm.finite import all_finite
from sparsecomm.payload import decode, encode
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.sparsify.adaptive import Adaptive
from sparsecomm.sparsify.base import Sparsifier
from sparsecomm.sparsify.nonzero import Nonzero
from sparsecomm.sparsify.shared_threshold import magnitude_sample
from sparsecomm.spec import PipelineSpec, format_spec, parse_spec

NONFINITE_POLICIES = ("raise", "skip", "zero")


def screen_nonfinite(values: torch.Tensor, policy: str) -> tuple[torch.Tensor | None, bool]:
    """Apply a ``nonfinite`` policy to ``values``: (the values to use — None to send nothing —,
    whether every rank must raise). Finite input passes through untouched."""
    if all_finite(values):
        return values, False
    if policy == "zero":
        return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0), False
    return None, policy == "raise"


@dataclass
class StepReport:
    """What the last step of one tensor did (``payload_bytes``: the payload it travelled in)."""

    selected: int
    target: int | None
    numel: int
    payload_bytes: int
    nonfinite: bool = False


@dataclass
class TensorState:
    """Everything a pipeline remembers about one tensor between steps."""

    step: int = 0
    feedback: dict[str, Any] = field(default_factory=dict)
    last: StepReport | None = None
    codec_error: torch.Tensor | None = None
    """a tensor sent whole: what a lossy codec lost of it, sent with its next step (flat)"""
    density_share: float = 1.0
    """with a planned density d, this tensor keeps d · share of its entries (`share_density`); on
    the device route, its bucket's floors are d / share (`sparsecomm.device.shares`)"""
    magnitudes: tuple[float, torch.Tensor] | None = None
    """this step's planned density and sample of its accumulated magnitudes, until `share_density`"""
    low_rank: torch.Tensor | None = None
    """a matrix's Q (columns × rank) from its last low-rank step, the next one's start
    (`sparsecomm.reducer.paths.low_rank`)"""


@dataclass(frozen=True)
class Segment:
    """A named tensor at ``[start, start + numel)`` of a flat buffer. ``whole``: send its gradient
    as it is — every nonzero, no sparsifier, no feedback — for tensors too small to be worth
    selecting (their caller applies `Feedback.update_uncompressed` to the average); what a lossy
    codec loses of it is held and goes with its next step (`TensorState.codec_error`)."""

    key: str
    start: int
    numel: int
    whole: bool = False


@dataclass
class StepOutput:
    """This rank's contribution for one step: the entries to send (values as the receivers will
    see them after decoding the payload), the payload, whether the input was non-finite, and the
    seconds encoding took (what a byte budget pays per payload byte besides the wire)."""

    selection: SparseGradient
    payload: bytes | None
    nonfinite: bool = False
    encode_s: float = 0.0


def seeded_generator(device: torch.device, *words: int) -> torch.Generator:
    """A generator on ``device`` seeded from ``words`` (mixed, so nearby words give unrelated streams)."""
    seed = int(np.random.SeedSequence([w & 0xFFFFFFFF for w in words]).generate_state(2, np.uint32).view(np.uint64)[0])
    return torch.Generator(device=device).manual_seed(seed >> 1)


def key_hash(key: str) -> int:
    return zlib.crc32(key.encode())


class Pipeline:
    """feedback → sparsify → encode for a stream of gradients, keyed by tensor name.

    Each tensor (by its key) keeps its own state — residual, momentum, step — in ``states``. A
    pipeline runs the local stages only: a `GradientReducer` owns one and adds the transport.

    Randomness comes from generators seeded from (``seed``, key, step), so every rank that builds
    the same pipeline with the same seed makes the same random choices, and a resumed run the same
    as an uninterrupted one; the global RNG is never used.

    Args:
        spec: a pipeline spec string or a parsed `PipelineSpec` (for a preset, pass
            ``PRESETS[name].spec``).
        seed: seeds every random choice.
        nonfinite: what a gradient holding NaN or ±Inf does, before anything enters its state:
            ``"raise"`` refuses the step, ``"skip"`` sends nothing from this tensor this step and
            steps its state as with a zero gradient, ``"zero"`` replaces those entries by 0 and goes on.
        world_size: the number of ranks (feeds DGC's local clipping threshold).

    Raises:
        SparseCommError: ``nonfinite`` is not one of the three policies.
        SpecError: ``spec`` is invalid.

    Example:
        ```python
        import torch

        import sparsecomm as sc

        pipe = sc.Pipeline("topk(ratio=0.01)+residual+rice+fp16", seed=0)
        for step in range(3):
            payload = pipe.compress(torch.randn(256, 256), key="layer1.weight")
        print(len(payload), "bytes;", pipe.states["layer1.weight"].step, "steps;", sc.decode(payload))
        ```
    """

    def __init__(self, spec: str | PipelineSpec, seed: int = 0, nonfinite: str = "raise", world_size: int = 1) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise SparseCommError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}")
        self.spec = parse_spec(spec)
        self.seed = seed
        self.nonfinite = nonfinite
        self.world_size = world_size
        self.states: dict[str, TensorState] = {}

    def __repr__(self) -> str:
        return f"Pipeline({format_spec(self.spec)!r}, seed={self.seed})"

    @property
    def sends_payloads(self) -> bool:
        """Whether the transport carries this pipeline's payloads (else it carries the selection)."""
        return self.spec.transport.carries_payloads

    def compress(self, grad: torch.Tensor, key: str = "") -> bytes:
        """One step for one tensor: feedback, sparsify, encode; the feedback learns what receivers
        will decode.

        Args:
            grad: the tensor's gradient this step.
            key: the tensor's name; its state is kept under it.

        Returns:
            The payload (`decode` reads it).

        Raises:
            SparseCommError: the gradient is non-finite under ``nonfinite="raise"``, or a codec cannot
                carry its values (beyond fp16's range).

        Example:
            ```python
            import torch

            import sparsecomm as sc

            pipe = sc.Pipeline("dgc(ratio=0.01)+residual+rice+fp32")
            received = sc.decode(pipe.compress(torch.randn(10_000), key="w"))
            print(received.nnz, "entries sent;", pipe.states["w"].last)
            ```
        """
        output = self.step(grad, key, make_payload=True)
        if output.nonfinite:
            raise SparseCommError(f"non-finite gradient for {key or 'tensor'} (nonfinite='raise')")
        assert output.payload is not None
        return output.payload

    def step(self, grad: torch.Tensor, key: str = "", make_payload: bool | None = None,
             segments: Sequence[Segment] | None = None, density: float | None = None) -> StepOutput:
        """One step: feedback, sparsify, encode (if ``make_payload``), then feedback learns what
        receivers will see. Unlike `compress`, a non-finite gradient does not raise: the output
        says so, and the caller (a reducer) decides with the other ranks.

        Args:
            grad: one tensor named ``key``, or with ``segments`` a flat buffer of named tensors.
            key: the tensor's name (with ``segments``: the buffer's).
            make_payload: encode a payload; by default when the transport carries payloads.
            segments: the named tensors of a flat ``grad`` (a DDP bucket), each with its own state,
                sparsified on its own; one payload carries them all.
            density: this step's density, for the ``adaptive`` sparsifier only.

        Returns:
            A `StepOutput`: the selection (values as receivers will decode them), the payload (or
            None), whether the input was non-finite, and the seconds encoding took.

        Raises:
            SparseCommError: ``density`` with a sparsifier other than ``adaptive``, or values a
                codec cannot carry.

        Example:
            ```python
            import torch

            import sparsecomm as sc

            pipe = sc.Pipeline("topk(ratio=0.1)+residual+rice+int8")
            output = pipe.step(torch.randn(1000), key="bias")
            print(output.selection.nnz, len(output.payload), output.nonfinite)
            ```
        """
        make_payload = self.sends_payloads if make_payload is None else make_payload
        flat = grad.detach().reshape(-1)
        # one tensor keeps its shape in its state; a buffer's segments are flat
        shapes = [grad.shape] if segments is None else [torch.Size([s.numel]) for s in segments]
        segments = segments or (Segment(key, 0, flat.numel()),)
        screened, must_raise = screen_nonfinite(flat, self.nonfinite)
        if screened is None:
            for segment in segments:
                state = self.states.setdefault(segment.key, TensorState())
                state.last = StepReport(0, None, segment.numel, 0, True)
                if not must_raise:  # skipped: the step of a zero gradient, as every other rank takes its own
                    self.idle(segment, state, flat)
            empty = SparseGradient(torch.zeros(0, dtype=torch.int64, device=grad.device),
                                   torch.zeros(0, dtype=grad.dtype, device=grad.device), grad.shape)
            return StepOutput(empty, None, nonfinite=must_raise)
        spec = self.spec
        states = [self.states.setdefault(segment.key, TensorState()) for segment in segments]
        accumulated, parts, targets = self._select(screened, segments, shapes, states, density)
        selection = join(parts, segments, grad.shape)
        payload, encoding = None, time.perf_counter()
        if make_payload:
            rng = np.random.default_rng([self.seed, key_hash(key), states[0].step])
            selection = selection.sorted()  # as the payload orders it
            dense = None  # where a lossy index codec sends more than the selection, the values come from here
            if not spec.index_codec.lossless:
                dense = accumulated[0] if len(accumulated) == 1 else torch.cat([a.reshape(-1) for a in accumulated])
            payload = encode(selection, spec.index_codec, spec.value_codec, rng=rng, dense=dense)
            if not codecs_lossless(spec.index_codec, spec.value_codec, grad.dtype):  # feedback sees what receivers see
                received = (spec.value_codec.as_decoded(selection.values)
                            if spec.index_codec.lossless and not spec.index_codec.codes_values else None)
                selection = (SparseGradient(selection.indices, received, selection.shape) if received is not None
                             else decode(payload, device=grad.device, expect=grad.shape))
                parts = split(selection, segments)
        encode_s = time.perf_counter() - encoding
        lossy = make_payload and not codecs_lossless(spec.index_codec, spec.value_codec, grad.dtype)
        for segment, state, acc, part, target in zip(segments, states, accumulated, parts, targets, strict=True):
            if not segment.whole:
                spec.feedback.update(acc, part, state.feedback)
            else:
                state.codec_error = codec_error(acc, part) if lossy else None
            state.step += 1
            state.last = StepReport(part.nnz, target if not segment.whole else part.nnz, segment.numel,
                                    len(payload) if payload is not None else 0)
        return StepOutput(selection, payload, encode_s=encode_s)

    def take_back(self, lost: SparseGradient, key: str = "", segments: Sequence[Segment] | None = None) -> None:
        """What the transport lost of this rank's last contribution under ``key`` (`Reduction.lost`,
        flat, sorted indices), held by each tensor's feedback to go with its later steps; a tensor
        sent whole holds it as it holds a lossy codec's error."""
        segments = segments or (Segment(key, 0, lost.numel),)
        for segment, part in zip(segments, split(lost, segments), strict=True):
            state = self.states[segment.key]
            if not segment.whole:
                self.spec.feedback.take_back(part, state.feedback)
                continue
            if state.codec_error is None:
                state.codec_error = torch.zeros(segment.numel, dtype=state_dtype(part.values.dtype),
                                                device=part.values.device)
            state.codec_error.index_add_(0, part.indices.to(state.codec_error.device),
                                         part.values.to(state.codec_error.device, state.codec_error.dtype))

    def idle(self, segment: Segment, state: TensorState, like: torch.Tensor, counted: bool = True) -> None:
        """A step this rank sits out (its gradient was non-finite): its feedback takes a zero
        gradient, so that its state stays of the other ranks' kind (DGC's momentum: each rank's own
        once any rank's step made it so), and, ``counted``, its step count moves on with theirs."""
        if not segment.whole:
            self.spec.feedback.accumulate(like.new_zeros(segment.numel), state.feedback)
        if counted:
            state.step += 1

    def _select(self, flat: torch.Tensor, segments: Sequence[Segment], shapes: list[torch.Size],
                states: list[TensorState],
                density: float | None) -> tuple[list[torch.Tensor], list[SparseGradient], list[int | None]]:
        """Per segment: its gradient with what its feedback holds, the entries selected from it, and
        the sparsifier's target count. A segment sent whole takes every nonzero."""
        chosen = self.spec.sparsifier if density is None else self.at_density(density)
        accumulated, parts, targets = [], [], []
        for segment, state, shape in zip(segments, states, shapes, strict=True):
            state.feedback["world_size"] = self.world_size
            piece = flat[segment.start:segment.start + segment.numel].view(shape)
            accumulated.append(with_codec_error(piece, state) if segment.whole
                               else self.spec.feedback.accumulate(piece, state.feedback))
            sparsifier: Sparsifier
            if segment.whole:
                sparsifier = Nonzero()
            elif density is None:
                sparsifier = chosen.at_step(state.step)
            else:  # the step's density, shared out by one threshold over the tensors (`share_density`)
                sparsifier = self.at_density(density * state.density_share).at_step(state.step)
                state.magnitudes = density, magnitude_sample(accumulated[-1], state.step)
            generator = None if segment.whole else seeded_generator(flat.device, self.seed, key_hash(segment.key),
                                                                    state.step)
            part = sparsifier.sparsify(accumulated[-1], generator)
            if part.values.dtype != flat.dtype:  # a half-precision gradient's fp32 feedback: values go in the
                # gradient's dtype, as every rank's do, and the feedback keeps what rounding them lost
                part = SparseGradient(part.indices, part.values.to(flat.dtype), part.shape)
            parts.append(part)
            targets.append(sparsifier.target_count(segment.numel))
        return accumulated, parts, targets

    def at_density(self, density: float) -> Adaptive:
        """The ``adaptive`` sparsifier at ``density``, clamped to its floor and 1.

        Args:
            density: the fraction of entries to keep.

        Returns:
            The pipeline's ``adaptive`` sparsifier set to that density.

        Raises:
            SparseCommError: the pipeline's sparsifier is not ``adaptive`` (other sparsifiers have
                no density to set).
        """
        if not isinstance(self.spec.sparsifier, Adaptive):
            raise SparseCommError(f"only the adaptive sparsifier takes a density per step, not "
                                  f"{self.spec.sparsifier.name}")
        return self.spec.sparsifier.at_density(density)

    def state_dict(self) -> dict[str, Any]:
        """Every tensor's state (step, feedback, density share, codec error, low-rank Q), with the spec and
        seed it belongs to: what `load_state_dict` needs to continue bit for bit."""
        return {
            "spec": format_spec(self.spec),
            "seed": self.seed,
            "tensors": {
                key: {"step": s.step,
                      "feedback": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.feedback.items()},
                      "density_share": s.density_share,
                      **({"codec_error": s.codec_error.clone()} if s.codec_error is not None else {}),
                      **({"low_rank": s.low_rank.clone()} if s.low_rank is not None else {})}
                for key, s in self.states.items()
            },
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise unless ``state`` (what `state_dict` returned) is for this spec and seed."""
        if parse_spec(state["spec"]) != self.spec or state["seed"] != self.seed:
            raise SparseCommError(
                f"state is for {state['spec']!r} seed {state['seed']}, this pipeline is {self!r} (a run whose "
                "pipeline `check_optimizer` changed resumes by calling it before `load_state_dict`)"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the tensors' state from `state_dict`.

        Args:
            state: what `state_dict` returned, for a pipeline of the same spec and seed.

        Raises:
            SparseCommError: the state is for another spec or seed.
        """
        self.check_state(state)
        self.states = {
            key: TensorState(step=saved["step"], feedback={k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                           for k, v in saved["feedback"].items()},
                             codec_error=saved["codec_error"].clone() if "codec_error" in saved else None,
                             density_share=saved["density_share"],
                             low_rank=saved["low_rank"].clone() if "low_rank" in saved else None)
            for key, saved in state["tensors"].items()
        }


def with_codec_error(piece: torch.Tensor, state: TensorState) -> torch.Tensor:
    """A tensor sent whole plus what codecs lost of it before (``piece`` itself when nothing was)."""
    if state.codec_error is None:
        return piece
    if state.codec_error.device != piece.device:  # a checkpoint loaded elsewhere
        state.codec_error = state.codec_error.to(piece.device)
    return piece.to(state_dtype(piece.dtype)) + state.codec_error.view(piece.shape)


def codec_error(sent: torch.Tensor, received: SparseGradient) -> torch.Tensor:
    """What receivers miss of ``sent`` (a tensor sent whole) given what they decode of it, flat, in
    the dtype feedback is kept in (`state_dtype`)."""
    error = sent.reshape(-1).to(state_dtype(sent.dtype), copy=True)
    error.index_add_(0, received.indices.to(error.device), received.values.to(error.dtype), alpha=-1)
    return error


def join(parts: Sequence[SparseGradient], segments: Sequence[Segment], shape: torch.Size) -> SparseGradient:
    """The segments' selections as one selection of the flat buffer (of ``shape``)."""
    if len(parts) == 1:
        return parts[0] if parts[0].shape == shape else SparseGradient(parts[0].indices, parts[0].values, shape)
    indices = torch.cat([part.indices + segment.start for part, segment in zip(parts, segments, strict=True)])
    return SparseGradient(indices, torch.cat([part.values for part in parts]), shape)


def split(selection: SparseGradient, segments: Sequence[Segment]) -> list[SparseGradient]:
    """A selection of the flat buffer (sorted indices) cut back into the segments' own selections."""
    if len(segments) == 1:
        return [selection]
    starts = torch.tensor([segment.start for segment in segments] + [segments[-1].start + segments[-1].numel],
                          device=selection.indices.device)
    bounds = torch.searchsorted(selection.indices, starts).tolist()
    return [SparseGradient(selection.indices[lo:hi] - segment.start, selection.values[lo:hi],
                           torch.Size([segment.numel]))
            for segment, lo, hi in zip(segments, bounds[:-1], bounds[1:], strict=True)]
