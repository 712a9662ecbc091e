"""Reproducer for a heap corruption in PyTorch's gloo backend (torch 2.13.0+cpu, glibc 2.36) with DDP
and sparse embeddings, with no sparsecomm code in it: DDP models with an ``Embedding(sparse=True)``,
two per process by default (each on its own gloo process group), trained in alternation. Some runs
die with ``malloc(): unaligned tcache chunk detected`` or a segmentation fault in a gloo worker
thread (``AsyncAllreduceWork::allreduce`` → ``createUnboundBuffer`` → malloc).

    python scripts/gloo_two_ddp_repro.py --steps 1000 --runs 10

Each run is a fresh pair of processes; the script prints each run's outcome and exits 1 if any run
crashed. ``--same-group`` puts both models on the default group; ``--dense`` makes the embeddings
dense; ``--models 1`` trains one model (crashes there were seen only while py-spy sampled the
processes). Figures: docs/known-issues.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VOCABULARY, CONTEXT, WIDTH, HIDDEN, BATCH = 5001, 4, 64, 256, 32


class NextWord(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH, sparse=sparse)
        self.hidden = nn.Linear(CONTEXT * WIDTH, HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCABULARY)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.output(torch.relu(self.hidden(self.embedding(context).flatten(1))))


def train(rank: int, world: int, port: int, steps: int, same_group: bool, sparse: bool, models_count: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    second = None if same_group else dist.new_group(ranks=list(range(world)))
    models = [DistributedDataParallel(NextWord(sparse)),
              DistributedDataParallel(NextWord(sparse), process_group=second)][:models_count]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    data = torch.Generator().manual_seed(rank)
    for step in range(steps):
        tokens = torch.randint(0, VOCABULARY, (BATCH, CONTEXT + 1), generator=data)
        for index in range(models_count) if step % 2 else reversed(range(models_count)):
            optimizers[index].zero_grad()
            loss = nn.functional.cross_entropy(models[index](tokens[:, :CONTEXT]), tokens[:, CONTEXT])
            loss.backward()
            optimizers[index].step()
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--same-group", action="store_true")
    parser.add_argument("--dense", action="store_true")
    parser.add_argument("--models", type=int, choices=(1, 2), default=2)
    args = parser.parse_args()
    crashed = 0
    for run in range(args.runs):
        run_args = (2, free_port(), args.steps, args.same_group, not args.dense, args.models)
        context = mp.start_processes(train, args=run_args, nprocs=2, join=False, start_method="spawn")
        try:
            while not context.join():
                pass
            status = "ok"
        except mp.ProcessExitedException as exited:
            status, crashed = f"crashed: {exited}", crashed + 1
        except mp.ProcessRaisedException as raised:  # the peer of a crashed rank loses its connection
            status, crashed = f"failed: {str(raised).splitlines()[-1]}", crashed + 1
        print(f"run {run + 1}/{args.runs}: {status}", flush=True)
    print(f"{crashed} of {args.runs} runs crashed (torch {torch.__version__})")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
