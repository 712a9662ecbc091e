"""How far a DDP bucket travels inside the reducer: from `ddp_comm_hook` to the transport it hands
the bucket to (or the all_reduce a dense step posts), every route passes through at most
`MOST_FUNCTIONS` of sparsecomm's functions and never returns to a module it left. Measured on the
call stack of a real step, at the moment of the hand-off."""

import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
import sparsecomm.reducer.paths.device as device_path
from sparsecomm.adaptive.config import Mode, Plan
from sparsecomm.launch import run_local
from sparsecomm.transport.allgather import AllgatherTransport
from sparsecomm.transport.base import Transport

MOST_FUNCTIONS = 8
PACKAGE = "/sparsecomm/"


def chain_to_handoff() -> list[tuple[str, str]]:
    """(module, function) of sparsecomm's frames from `ddp_comm_hook` through a bucket's reduction
    to the hand-off: the first frame in the transports, or the caller of the recorded collective."""
    frames = [(frame.filename.split(PACKAGE)[-1], frame.name) for frame in traceback.extract_stack()[:-2]
              if PACKAGE in frame.filename]
    hooks = [i for i, (_, name) in enumerate(frames) if name == "ddp_comm_hook"]
    if not hooks or "reduce_bucket_async" not in (name for _, name in frames[hooks[-1]:]):
        return []
    chain = frames[hooks[-1]:]
    transport = next((i for i, (module, _) in enumerate(chain) if module.startswith("transport/")), len(chain))
    return chain[:transport]


CASES = [("dgc", None, False), ("topk(ratio=0.5)+residual+rice+fp32+allgather", None, False), ("dgc", None, True),
         ("dense", None, False), ("sparcml", None, False), ("adaptive", Mode.FP32, False),
         ("adaptive", Mode.FP16, False), ("adaptive", Mode.SPARSE, True),
         ("dgc(ratio=0.01)+dgc_momentum(momentum=0.9)+raw+fp32+allgather", None, False)]
"""(spec, the adaptive mode forced on every step, whether the model has a sparse embedding)"""


def recorded_chains(rank: int, world: int) -> list[set[tuple]]:
    """Per case, every distinct chain by which a bucket reached its hand-off in a few DDP steps."""
    chains: set[tuple] = set()

    def recording(function):
        def handoff(*args, **kwargs):
            chain = chain_to_handoff()
            if chain:
                chains.add(tuple(chain))
            return function(*args, **kwargs)
        return handoff

    for cls in {type(sc.TRANSPORTS.create(name, {})) for name in sc.TRANSPORTS.names()}:
        if "reduce" in vars(cls):
            cls.reduce = recording(cls.reduce)
    Transport.reduce_async = recording(Transport.reduce_async)
    AllgatherTransport.reduce_fused = recording(AllgatherTransport.reduce_fused)
    dist.ProcessGroup.allreduce = recording(dist.ProcessGroup.allreduce)
    device_path.all_gather_single = recording(device_path.all_gather_single)
    per_case = []
    for spec, forced, embedding in CASES:
        chains = set()
        train(spec, forced, embedding)
        per_case.append(chains)
    return per_case


def train(spec: str, forced: Mode | None, embedding: bool) -> None:
    """A few DDP steps of a small model with ``spec``'s hook."""
    torch.manual_seed(0)
    first = [torch.nn.EmbeddingBag(1000, 64, sparse=True)] if embedding else [torch.nn.Linear(64, 64)]
    # a 32k-entry matrix: at half its entries, a call too large to wait for the step's last
    model = torch.nn.Sequential(*first, torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ddp = DDP(model, bucket_cap_mb=0.05)  # several buckets: asynchronous calls, and the last on this thread
    reducer = sc.register_ddp_hook(ddp, spec)
    if forced is not None:
        assert reducer.adaptive is not None
        reducer.adaptive.planner.plan = lambda: Plan(forced, 0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        data = torch.randint(1000, (32, 8)) if embedding else torch.randn(32, 64)
        optimizer.zero_grad()
        ddp(data).square().mean().backward()
        optimizer.step()
    reducer.close()


def test_every_route_reaches_its_collective_in_few_functions_and_never_turns_back():
    handoffs = set()
    for (spec, forced, _), chains in zip(CASES, run_local(2, recorded_chains)[0], strict=True):
        assert chains, spec
        handoffs |= {chain[-1] for chain in chains}
        for chain in chains:
            modules = [module for module, _ in chain]
            visits = [module for i, module in enumerate(modules) if i == 0 or module != modules[i - 1]]
            shown = " > ".join(f"{module}:{name}" for module, name in chain)
            assert len(chain) <= MOST_FUNCTIONS, f"{spec}, {forced}: {len(chain)} functions: {shown}"
            assert len(visits) == len(set(visits)), f"{spec}, {forced}: back in a module it left: {shown}"
    # calls for the worker thread, a step's last call with those that waited, a dense step's all_reduce,
    # the device route's all_gather (and, once per bucket, the ranks' agreement on its layout), and
    # (once, at dgc's first compressed call) the ranks' agreement on whether their gradients are all on GPUs
    assert handoffs == {("reducer/step_calls.py", "post"), ("reducer/step_calls.py", "_exchange_deferred"),
                        ("reducer/paths/dense_step.py", "post"), ("reducer/paths/device.py", "post"),
                        ("reducer/paths/device.py", "_agree_layout"), ("reducer/runtime.py", "_all_on_gpus")}
