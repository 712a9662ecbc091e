"""`Pipeline`: one spec string's stages applied step after step, with per-tensor state.

    pipe = Pipeline("topk(ratio=0.01)+residual+rice+fp16")
    payload = pipe.compress(grad, key="layer1.weight")   # bytes, self-describing
    received = sparsecomm.decode(payload)                # SparseGradient
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparsecomm.payload import decode, encode
from sparsecomm.sparse_gradient import SparseGradient
from sparsecomm.spec import PipelineSpec, format_spec, parse_spec


@dataclass
class StepReport:
    """What the last `Pipeline.compress` of one tensor did."""

    selected: int
    target: int | None
    numel: int
    payload_bytes: int


@dataclass
class TensorState:
    """Everything a pipeline remembers about one tensor between steps."""

    step: int = 0
    feedback: dict[str, Any] = field(default_factory=dict)
    generator: torch.Generator | None = None
    last: StepReport | None = None


class Pipeline:
    """sparsify → feedback → encode for a stream of gradients, keyed by tensor name.

    Randomness comes from generators seeded from (``seed``, key, step), so every rank that builds
    the same pipeline with the same seed makes the same random choices; the global RNG is never used.
    """

    def __init__(self, spec: str | PipelineSpec, seed: int = 0) -> None:
        self.spec = parse_spec(spec)
        self.seed = seed
        self.states: dict[str, TensorState] = {}

    def __repr__(self) -> str:
        return f"Pipeline({format_spec(self.spec)!r}, seed={self.seed})"

    def compress(self, grad: torch.Tensor, key: str = "") -> bytes:
        state = self.states.setdefault(key, TensorState())
        key_hash = zlib.crc32(key.encode())
        if state.generator is None or state.generator.device != grad.device:
            state.generator = torch.Generator(device=grad.device).manual_seed(
                (self.seed << 32) ^ key_hash
            )
        spec = self.spec
        accumulated = spec.feedback.accumulate(grad.detach(), state.feedback)
        selection: SparseGradient = spec.sparsifier.sparsify(accumulated, state.generator)
        rng = np.random.default_rng([self.seed, key_hash, state.step])
        payload = encode(selection, spec.index_codec, spec.value_codec, rng=rng)
        if not spec.value_codec.lossless:
            selection = decode(payload, device=grad.device)  # error feedback sees what receivers see
        spec.feedback.update(accumulated, selection, state.feedback)
        state.step += 1
        state.last = StepReport(selection.nnz, spec.sparsifier.target_count(grad.numel()), grad.numel(), len(payload))
        return payload

    def state_dict(self) -> dict[str, Any]:
        return {
            "spec": format_spec(self.spec),
            "seed": self.seed,
            "tensors": {
                key: {
                    "step": s.step,
                    "feedback": dict(s.feedback),
                    "generator": None if s.generator is None else s.generator.get_state(),
                }
                for key, s in self.states.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from sparsecomm.errors import SparseCommError

        if parse_spec(state["spec"]) != self.spec or state["seed"] != self.seed:
            raise SparseCommError(
                f"state is for {state['spec']!r} seed {state['seed']}, this pipeline is {self!r}"
            )
        self.states = {}
        for key, saved in state["tensors"].items():
            tensor_state = TensorState(step=saved["step"], feedback=dict(saved["feedback"]))
            if saved["generator"] is not None:
                tensor_state.generator = torch.Generator()
                tensor_state.generator.set_state(saved["generator"])
            self.states[key] = tensor_state
