"""A decoder-only transformer trained with AdamW on text every machine has: the Python standard
library's own sources (code and docstrings), read as bytes.

Bytes are the tokens (a vocabulary of 256): no tokenizer to train or download, and the same tokens
on every machine with the same Python. The model is GPT-2's shape — token and position embeddings,
pre-norm blocks of causal self-attention and an MLP, a final norm, the output tied to the token
embedding — at two sizes: ``gpt`` for CPUs and ``gpt-large`` for GPUs."""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from sparsecomm.errors import SparseCommError
from sparsecomm.train.evaluation import Evaluation
from sparsecomm.train.regime import BREAK_EVEN


@dataclass(frozen=True)
class GPTShape:
    """A model's size: width, blocks, attention heads and context length (in bytes)."""

    width: int
    blocks: int
    heads: int
    context: int


SMALL = GPTShape(width=144, blocks=8, heads=4, context=64)
"""2.0M parameters in 100 tensors: about 0.1 s per step of 8 sequences on one CPU core"""

LARGE = GPTShape(width=768, blocks=8, heads=12, context=256)
"""57M parameters in 100 tensors: for GPUs"""

SKIPPED = ("test", "tests", "site-packages", "__pycache__", "idlelib")
"""standard-library folders left out (tests repeat the code they test; site-packages varies)"""


class StdlibGPT:
    """Next-byte prediction over the standard library's ``.py`` files (at most ``max_bytes`` of them,
    in sorted order; every tenth 4 kB block held out, so the held-out text is the same mix of
    modules). Trained with AdamW; under CUDA in bf16 autocast. Metric: held-out perplexity per byte
    (lower is better)."""

    metric_name = "perplexity"
    higher_is_better = False
    optimizer = "adamw"
    learning_rates = MappingProxyType({"adamw": 1e-3})
    warmup_share = 0.1
    """the share of the steps the learning rate warms up over, then decays (`UpdateRule.schedule`):
    as transformers are trained with AdamW"""
    default_presets = ("adaptive", "dgc")
    """the rows `sparsecomm train` runs unless told (with dense and PyTorch's hooks): every preset would
    take a quarter of an hour on 2 CPU cores"""
    regime = BREAK_EVEN
    ddp_broadcast_buffers = True
    """whether DDP sends rank 0's buffers to every rank at each forward (it has none to send)"""
    EVALUATED_BYTES = 32_768
    """held-out bytes the metric is measured on (the same every evaluation)"""
    BLOCK = 4096
    """the split's unit: every tenth block of this many bytes is held out"""

    def __init__(self, shape: GPTShape = SMALL, name: str = "gpt", default_batch: int = 8,
                 default_steps: int = 120, max_bytes: int = 4_000_000, ddp_bucket_mb: float | None = 2.0) -> None:
        self.shape, self.name = shape, name
        self.default_batch, self.default_steps = default_batch, default_steps
        self.ddp_bucket_mb = ddp_bucket_mb
        """the size of the DDP buckets its rows train in (None: PyTorch's default, 25 MB). PyTorch's
        default holds the 8 MB default model in two buckets, the larger ready only as the backward
        ends; in buckets of 2 MB (four) each bucket's collectives cross the link while the backward
        computes the next"""
        text = _stdlib_source(max_bytes)
        if len(text) < 100_000:
            raise SparseCommError(f"found only {len(text)} bytes of standard-library source")
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)  # bytes: cheap to hand to each worker
        blocks = tokens[: len(tokens) // self.BLOCK * self.BLOCK].view(-1, self.BLOCK)
        held_out = torch.arange(len(blocks)) % 10 == 9
        self.train_tokens, self.test_tokens = blocks[~held_out].flatten(), blocks[held_out].flatten()

    def model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng():  # initialise from the run's seed without disturbing the caller's RNG
            torch.manual_seed(seed)
            return GPT(self.shape)

    def batches(self, rank: int, world: int, steps: int, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """Each rank draws its own windows of ``context + 1`` bytes, from a generator seeded by rank."""
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        limit, span = len(self.train_tokens) - self.shape.context - 1, torch.arange(self.shape.context + 1)
        for _ in range(steps):
            windows = self.train_tokens[torch.randint(limit, (batch,), generator=generator)[:, None] + span].long()
            yield windows[:, :-1], windows[:, 1:]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        inputs, targets = batch
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=inputs.is_cuda):
            logits = model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def evaluate(self, model: nn.Module) -> Evaluation:
        context = self.shape.context
        usable = min(self.EVALUATED_BYTES, len(self.test_tokens) - 1) // context * context
        inputs = self.test_tokens[:usable].long().view(-1, context)
        targets = self.test_tokens[1 : usable + 1].long().view(-1, context)
        device = next(model.parameters()).device
        total = 0.0
        with torch.no_grad():
            for chunk in range(0, len(inputs), 64):
                batch = (inputs[chunk : chunk + 64].to(device), targets[chunk : chunk + 64].to(device))
                total += float(self.loss(model, batch)) * len(batch[0]) * context
        loss = total / usable
        return Evaluation(math.exp(loss), loss)


class GPT(nn.Module):
    """GPT-2's architecture over bytes: embeddings, pre-norm blocks, final norm, tied output."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.tokens = nn.Embedding(256, shape.width)
        self.positions = nn.Embedding(shape.context, shape.width)
        self.blocks = nn.ModuleList(Block(shape.width, shape.heads) for _ in range(shape.blocks))
        self.norm = nn.LayerNorm(shape.width)
        for name, parameter in self.named_parameters():
            if name.endswith("weight") and parameter.dim() == 2:
                # GPT-2's initialisation; the projections back into the residual stream scaled by depth
                std = 0.02 / math.sqrt(2 * shape.blocks) if name.endswith("out.weight") else 0.02
                nn.init.normal_(parameter, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            hidden = block(hidden)
        return self.norm(hidden) @ self.tokens.weight.T  # the output tied to the token embedding


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then a 4x-wide GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attention_out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp_in = nn.Linear(width, 4 * width)
        self.mlp_out = nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        q, k, v = self.qkv(self.attention_norm(hidden)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden = hidden + self.attention_out(attended.transpose(1, 2).reshape(batch, length, width))
        return hidden + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(hidden))))


def _stdlib_source(max_bytes: int) -> bytes:
    """The standard library's ``.py`` files, in sorted order, up to ``max_bytes``."""
    root, parts, size = sysconfig.get_paths()["stdlib"], [], 0
    for directory, subdirectories, files in sorted(os.walk(root)):
        subdirectories[:] = sorted(d for d in subdirectories if d not in SKIPPED)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(directory, name), "rb") as handle:
                    parts.append(handle.read())
            except OSError:
                continue
            size += len(parts[-1])
            if size >= max_bytes:
                return b"".join(parts)[:max_bytes]
    return b"".join(parts)
