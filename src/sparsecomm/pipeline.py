"""`Pipeline`: one spec string's local stages (feedback → sparsify → encode) applied step after step,
with per-tensor state.

    pipe = Pipeline("topk(ratio=0.01)+residual+rice+fp16")
    payload = pipe.compress(grad, key="layer1.weight")   # bytes, self-describing
    received = sparsecomm.decode(payload)                # SparseGradient

Non-finite gradients are handled before anything enters residuals or momenta, by ``nonfinite``:
``"raise"`` (default) refuses the step, ``"skip"`` sends nothing from this tensor this step and
leaves its state untouched, ``"zero"`` replaces NaN/±Inf entries by 0 and goes on.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparsecomm.encode.base import codecs_lossless
from sparsecomm.errors import SparseCommError
from sparsecomm.payload import decode, encode
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.spec import PipelineSpec, format_spec, parse_spec

NONFINITE_POLICIES = ("raise", "skip", "zero")


def screen_nonfinite(values: torch.Tensor, policy: str) -> tuple[torch.Tensor | None, bool]:
    """Apply a ``nonfinite`` policy to ``values``: (the values to use — None to send nothing —,
    whether every rank must raise). Finite input passes through untouched."""
    if bool(torch.isfinite(values).all()):
        return values, False
    if policy == "zero":
        return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0), False
    return None, policy == "raise"


@dataclass
class StepReport:
    """What the last step of one tensor did."""

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
    generator: torch.Generator | None = None
    last: StepReport | None = None


@dataclass
class StepOutput:
    """This rank's contribution for one tensor: the entries to send (values as the receivers will
    see them after decoding the payload), the payload, and whether the input was non-finite."""

    selection: SparseGradient
    payload: bytes | None
    nonfinite: bool = False


class Pipeline:
    """feedback → sparsify → encode for a stream of gradients, keyed by tensor name.

    Randomness comes from generators seeded from (``seed``, key, step), so every rank that builds
    the same pipeline with the same seed makes the same random choices; the global RNG is never used.
    ``world_size`` feeds DGC's local clipping threshold.
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
        """One step for one tensor; returns its payload."""
        output = self.step(grad, key, make_payload=True)
        if output.nonfinite:
            raise SparseCommError(f"non-finite gradient for {key or 'tensor'} (nonfinite='raise')")
        assert output.payload is not None
        return output.payload

    def step(self, grad: torch.Tensor, key: str = "", make_payload: bool | None = None) -> StepOutput:
        """One step for one tensor: feedback, sparsify, encode (if ``make_payload``, by default when
        the transport carries payloads), then feedback learns what receivers will see."""
        make_payload = self.sends_payloads if make_payload is None else make_payload
        state = self.states.setdefault(key, TensorState())
        screened, must_raise = screen_nonfinite(grad.detach(), self.nonfinite)
        if screened is None:
            empty = SparseGradient(torch.zeros(0, dtype=torch.int64, device=grad.device),
                                   torch.zeros(0, dtype=grad.dtype, device=grad.device), grad.shape)
            state.last = StepReport(0, None, grad.numel(), 0, nonfinite=True)
            return StepOutput(empty, None, nonfinite=must_raise)
        grad = screened
        spec = self.spec
        key_hash = zlib.crc32(key.encode())
        if state.generator is None or state.generator.device != grad.device:
            state.generator = torch.Generator(device=grad.device).manual_seed((self.seed << 32) ^ key_hash)
        state.feedback["world_size"] = self.world_size
        accumulated = spec.feedback.accumulate(grad, state.feedback)
        sparsifier = spec.sparsifier.at_step(state.step)
        selection: SparseGradient = sparsifier.sparsify(accumulated, state.generator)
        payload = None
        if make_payload:
            rng = np.random.default_rng([self.seed, key_hash, state.step])
            payload = encode(selection, spec.index_codec, spec.value_codec, rng=rng, dense=accumulated)
            if not codecs_lossless(spec.index_codec, spec.value_codec):
                selection = decode(payload, device=grad.device)  # feedback sees what receivers see
        spec.feedback.update(accumulated, selection, state.feedback)
        state.step += 1
        state.last = StepReport(selection.nnz, sparsifier.target_count(grad.numel()), grad.numel(),
                                len(payload) if payload is not None else 0)
        return StepOutput(selection, payload)

    def state_dict(self) -> dict[str, Any]:
        return {
            "spec": format_spec(self.spec),
            "seed": self.seed,
            "tensors": {
                key: {
                    "step": s.step,
                    "feedback": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.feedback.items()},
                    "generator": None if s.generator is None else s.generator.get_state(),
                    "device": None if s.generator is None else str(s.generator.device),
                }
                for key, s in self.states.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if parse_spec(state["spec"]) != self.spec or state["seed"] != self.seed:
            raise SparseCommError(
                f"state is for {state['spec']!r} seed {state['seed']}, this pipeline is {self!r}"
            )
        self.states = {}
        for key, saved in state["tensors"].items():
            feedback = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in saved["feedback"].items()}
            tensor_state = TensorState(step=saved["step"], feedback=feedback)
            if saved["generator"] is not None:
                tensor_state.generator = torch.Generator(device=saved.get("device") or "cpu")
                tensor_state.generator.set_state(saved["generator"])
            self.states[key] = tensor_state
