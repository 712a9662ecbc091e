"""The lm workload: a next-word model with a sparse embedding over the standard library's docstrings."""

from __future__ import annotations

from collections.abc import Iterator
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from sparsecomm.errors import SparseCommError
from sparsecomm.train.evaluation import Evaluation
from sparsecomm.train.regime import RESNET50_ON_1GBE


class StdlibLanguageModel:
    """A word-level language model over real English prose already on every machine: the docstrings
    of Python's standard library (tests and site-packages skipped), at most 400k words, 90% to train
    and the last 10% held out. The model predicts a word from the 4 before it: a 5,001-word
    ``Embedding(sparse=True)`` (its gradient is sparse rows, as in the seeds' LSTM cases), a hidden
    layer, and a dense 256→5,001 output layer. Metric: held-out perplexity (lower is better)."""

    name = "lm"
    metric_name = "perplexity"
    higher_is_better = False
    optimizer = "sgd"
    learning_rates = MappingProxyType({"sgd": 0.1})
    warmup_share = 0.0
    """no warm-up: a constant learning rate (`UpdateRule.schedule`)"""
    default_batch, default_steps = 32, 300
    ddp_bucket_mb: float | None = None
    """the size of the DDP buckets its rows train in (None: PyTorch's default)"""
    ddp_broadcast_buffers = True
    """whether DDP sends rank 0's buffers to every rank at each forward (it has none to send)"""
    default_presets = None
    regime = RESNET50_ON_1GBE
    CONTEXT, VOCAB, MAX_WORDS = 4, 5000, 400_000

    def __init__(self) -> None:
        import ast
        import collections
        import os
        import re
        import sysconfig

        root = sysconfig.get_paths()["stdlib"]
        word = re.compile(r"[a-z]+(?:'[a-z]+)?|[.,;:()]")
        words: list[str] = []
        for directory, subdirectories, files in sorted(os.walk(root)):
            subdirectories[:] = sorted(d for d in subdirectories
                                       if d not in ("test", "tests", "site-packages", "__pycache__", "idlelib"))
            for name in sorted(f for f in files if f.endswith(".py")):
                try:
                    with open(os.path.join(directory, name), encoding="utf-8") as handle:
                        tree = ast.parse(handle.read())
                except (SyntaxError, UnicodeDecodeError, OSError):
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                        docstring = ast.get_docstring(node)
                        if docstring:
                            words += word.findall(docstring.lower())
                if len(words) >= self.MAX_WORDS:
                    break
            if len(words) >= self.MAX_WORDS:
                break
        if len(words) < 10_000:
            raise SparseCommError(f"found only {len(words)} words of docstrings under {root}")
        vocabulary = [w for w, _ in collections.Counter(words).most_common(self.VOCAB)]
        index = {w: i + 1 for i, w in enumerate(vocabulary)}  # 0: any other word
        tokens = torch.tensor([index.get(w, 0) for w in words[: self.MAX_WORDS]], dtype=torch.int64)
        split = int(0.9 * len(tokens))
        self.train_tokens, self.test_tokens = tokens[:split], tokens[split:]
        self.vocabulary_size = self.VOCAB + 1

    def model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return _NextWord(self.vocabulary_size, self.CONTEXT)

    def _windows(self, tokens: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.arange(self.CONTEXT)
        return tokens[starts[:, None] + offsets], tokens[starts + self.CONTEXT]

    def batches(self, rank: int, world: int, steps: int, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
        generator = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank its own positions
        limit = len(self.train_tokens) - self.CONTEXT
        for _ in range(steps):
            yield self._windows(self.train_tokens, torch.randint(limit, (batch,), generator=generator))

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        context, target = batch
        return F.cross_entropy(model(context), target)

    def evaluate(self, model: nn.Module) -> Evaluation:
        starts = torch.arange(0, len(self.test_tokens) - self.CONTEXT, 2)
        device = next(model.parameters()).device
        total = 0.0
        with torch.no_grad():
            for chunk in torch.split(starts, 2048):  # 2048 × 5001 logits at a time
                context, target = self._windows(self.test_tokens, chunk)
                total += float(F.cross_entropy(model(context.to(device)), target.to(device), reduction="sum"))
        loss = total / len(starts)
        return Evaluation(float(torch.exp(torch.tensor(loss))), loss)


class _NextWord(nn.Module):
    def __init__(self, vocabulary: int, context: int, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width, sparse=True)
        self.hidden = nn.Linear(context * width, hidden)
        self.output = nn.Linear(hidden, vocabulary)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.output(torch.tanh(self.hidden(self.embedding(context).flatten(1))))
