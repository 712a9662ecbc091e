"""Training workloads with no download at run time: data shipped by a package or with Python."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from sparsecomm.errors import SparseCommError
from sparsecomm.train.cnn import DigitsResNet
from sparsecomm.train.evaluation import Evaluation
from sparsecomm.train.gpt import LARGE, StdlibGPT
from sparsecomm.train.regime import RESNET50_ON_1GBE


class Digits:
    """scikit-learn's handwritten digits (1,797 8×8 images, shipped with the package): an MLP
    64→512→256→10 (~166k parameters), 1,500 images to train on, 297 held out; metric: accuracy."""

    name = "digits"
    metric_name = "accuracy"
    higher_is_better = True
    optimizer = "sgd"
    learning_rates = MappingProxyType({"sgd": 0.05, "adamw": 1e-3})
    default_batch, default_steps = 32, 300
    default_presets = None
    regime = RESNET50_ON_1GBE

    def __init__(self) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise SparseCommError("the digits workload needs scikit-learn: pip install 'sparsecomm[train]'") from None
        digits = load_digits()
        images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.int64)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        images, labels = images[order], labels[order]
        self.train_x, self.train_y = images[:1500], labels[:1500]
        self.test_x, self.test_y = images[1500:], labels[1500:]

    def model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng():  # initialise from the run's seed without disturbing the caller's RNG
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))

    def batches(self, rank: int, world: int, steps: int, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """Each rank's shard, reshuffled every epoch by a generator all ranks seed alike."""
        generator = torch.Generator().manual_seed(seed)
        shard = torch.arange(rank, len(self.train_y), world)
        position, order = len(shard), shard
        for _ in range(steps):
            if position + batch > len(shard):
                order, position = shard[torch.randperm(len(shard), generator=generator)], 0
            chosen = order[position : position + batch]
            position += batch
            yield self.train_x[chosen], self.train_y[chosen]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels)

    def evaluate(self, model: nn.Module) -> Evaluation:
        device = next(model.parameters()).device
        test_x, test_y = self.test_x.to(device), self.test_y.to(device)
        with torch.no_grad():
            logits = model(test_x)
            accuracy = float((logits.argmax(1) == test_y).float().mean())
            return Evaluation(100.0 * accuracy, float(F.cross_entropy(logits, test_y)))


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
    default_batch, default_steps = 32, 300
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


Workload = Digits | StdlibLanguageModel | StdlibGPT | DigitsResNet
WORKLOADS: Mapping[str, Callable[[], Workload]] = MappingProxyType({
    "digits": Digits, "cnn": lambda: DigitsResNet(Digits()), "lm": StdlibLanguageModel, "gpt": StdlibGPT,
    "gpt-large": lambda: StdlibGPT(LARGE, name="gpt-large", default_batch=32),
})
"""every workload by name: how to build it"""


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise SparseCommError(f"unknown workload {name!r}; available: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()
