"""Integration you can trust: state follows its parameter through DDP's bucket rebuild and a resume in
fresh processes, ranks can never sum the wrong tensors, errors inside the DDP hook keep their type,
no argument is silently ignored, and the reducer owns (and checkpoints, and releases) all its state."""

import ast
import copy
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm as sc
from sparsecomm.launch import run_local
from test_training import batches, digest, mlp

SOURCE = Path(sc.__file__).resolve().parent


def capturing_hook(state: tuple, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """sparsecomm's hook, after noting the bucket's layout and this rank's local gradients."""
    reducer, names, log = state
    parameters = bucket.parameters()
    log.append(([names[id(p)] for p in parameters],
                {names[id(p)]: g.detach().clone() for p, g in zip(parameters, bucket.gradients(), strict=True)}))
    return sc.ddp_comm_hook(reducer, bucket)


def residuals_through_a_rebuild(rank: int, world: int, spec: str) -> dict:
    model = DDP(mlp(0))
    reducer = sc.GradientReducer(spec, model=model, dense_below=1)
    names = {id(p): name for name, p in model.module.named_parameters()}
    log: list = []
    model.register_comm_hook((reducer, names, log), capturing_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for data, labels in batches(rank, world, 4):
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
    # the same pipeline, run on each parameter alone, from the gradients this rank really had
    reference = sc.Pipeline(spec)
    sent = {name: torch.zeros(grad.numel()) for name, grad in log[0][1].items()}
    for _, gradients in log:
        for name, grad in gradients.items():
            sent[name] += reference.step(grad, name).selection.to_dense().view(-1)
    return {"layouts": [layout for layout, _ in log], "sent": sent,
            "grad_sums": {name: sum(g[name] for _, g in log) for name in log[0][1]},
            "mine": {name: state.feedback["residual"].clone() for name, state in reducer.pipeline.states.items()},
            "reference": {name: state.feedback["residual"].view(-1) for name, state in reference.states.items()}}


def test_residuals_stay_with_their_parameters_when_ddp_rebuilds_a_bucket_to_the_same_size():
    result = run_local(2, residuals_through_a_rebuild, "topk(ratio=0.1)+residual+raw+fp32+allgather")[0]
    layouts = result["layouts"]
    assert layouts[0] != layouts[1] and sorted(layouts[0]) == sorted(layouts[1])  # rebuilt: same size, new order
    assert set(result["mine"]) == set(result["reference"]) == set(layouts[0])
    for name, residual in result["mine"].items():
        assert torch.equal(residual, result["reference"][name]), name
        # sent + residual = the sum of this parameter's own gradients
        torch.testing.assert_close(result["sent"][name] + residual, result["grad_sums"][name].view(-1))


def train_ddp_and_checkpoint(rank: int, world: int, spec: str, steps: int, resume_at: int,
                             saved: list | None) -> dict:
    """Train ``steps`` steps; keep a checkpoint at ``resume_at``. With ``saved``, start from it instead."""
    model = DDP(mlp(0))
    reducer = sc.GradientReducer(spec, model=model, seed=5)
    model.register_comm_hook(reducer, sc.ddp_comm_hook)
    applies_momentum = reducer.spec.feedback.applies_momentum
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if applies_momentum else 0.9)
    start = 0
    if saved is not None:
        model.module.load_state_dict(saved[rank]["model"])
        optimizer.load_state_dict(saved[rank]["optimizer"])
        reducer.load_state_dict(saved[rank]["sparsecomm"])
        start = resume_at
    checkpoint = None
    for step, (data, labels) in enumerate(batches(rank, world, steps)):
        if step < start:
            continue
        if step == resume_at and saved is None:
            checkpoint = copy.deepcopy({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                        "sparsecomm": reducer.state_dict()})
        optimizer.zero_grad()
        F.cross_entropy(model(data), labels).backward()
        optimizer.step()
    reducer.close()
    chosen = {key: tuning.chosen for key, tuning in reducer.runtime.session.tunings.items()}
    return {"digest": digest(model.module), "checkpoint": checkpoint, "chosen": chosen}


@pytest.mark.parametrize(("world", "spec"), [
    (3, "topk(ratio=0.5)+residual+rice+fp32+allgather"),  # selections overlap across ranks
    (3, "dgc(ratio=0.01)+dgc_momentum+rle+fp32+allgather"),  # DGC's sampled threshold, momentum of whole biases
    # a dense all_reduce at 3+ ranks rounds each sum by its position in the buffer, and the first step
    # after a resume runs on DDP's initial bucket layout: the reducer reduces it in the checkpoint's layout
    (3, "dense"),
    (3, "topk(ratio=0.5)+residual+rice+fp32+auto(explore=1)"),
    (2, "topk(ratio=0.01)+dgc_momentum+rle+fp32+auto(explore=1)"),
    # a global top-k's ranges follow the counts of the call before: they come back with the checkpoint
    (3, "topk(ratio=0.05)+residual+raw+fp32+sparse_allreduce(algorithm=topk_sa)"),
    # a user-set budget: the plan (sparse, dense, fp16) comes from bytes alone, so a resume repeats it
    (2, "adaptive(budget=20000)+dgc_momentum(masking=false,nesterov=true)+rice+int8+allgather"),
    (2, "adaptive(budget=400000)+residual+rice+int8+allgather"),
    # every step dense: DGC's momentum is the ranks' common buffer, advanced with the average
    (2, "adaptive(budget=400000)+dgc_momentum(masking=false,nesterov=true)+rice+int8+allgather"),
])
def test_a_ddp_run_resumed_in_fresh_processes_equals_the_uninterrupted_run_bit_for_bit(world, spec):
    steps, resume_at = 18, 13  # auto(explore=1) has settled by then (at most 11 trials)
    straight = run_local(world, train_ddp_and_checkpoint, spec, steps, resume_at, None)
    assert len({r["digest"] for r in straight}) == 1
    resumed = run_local(world, train_ddp_and_checkpoint, spec, steps, resume_at, [r["checkpoint"] for r in straight])
    assert [r["digest"] for r in resumed] == [r["digest"] for r in straight]
    if "auto" in spec:  # auto's choices came back with the checkpoint
        assert resumed[0]["chosen"] == straight[0]["chosen"] and all(straight[0]["chosen"].values())


def one_rank_resumes(rank: int, world: int, spec: str) -> str:
    """Three DDP steps; then rank 0 loads their checkpoint and rank 1 starts afresh."""
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, spec)
    data = list(batches(rank, world, 4))
    for inputs, labels in data[:3]:
        F.cross_entropy(model(inputs), labels).backward()
    saved = reducer.state_dict()
    reducer.close()
    model = DDP(mlp(0))
    reducer = sc.register_ddp_hook(model, spec)
    if rank == 0:
        reducer.load_state_dict(saved)
    try:
        F.cross_entropy(model(data[3][0]), data[3][1]).backward()
    except sc.SparseCommError as err:
        return str(err)
    finally:
        reducer.close()
    return "no error"


@pytest.mark.parametrize("spec", ["topk(ratio=0.01)+residual+rice+fp32+allgather", "dgc"])
def test_a_rank_that_resumes_next_to_one_that_starts_afresh_fails_clearly_on_every_rank(spec):
    """Their calls disagree, which every rank says; a payload capacity restored on one rank alone
    would instead have gloo abort the process on a message longer than the other expects."""
    for message in run_local(2, one_rank_resumes, spec):
        assert message != "no error"


def named_in_different_orders(rank: int, world: int, kind: str) -> dict:
    a, b = torch.full((5000,), 1.0 + rank), torch.full((5000,), 10.0 * (rank + 1))
    named = [("a", a), ("b", b)]
    if kind == "order" and rank == 1:
        named.reverse()
    if kind == "count" and rank == 1:
        named = named[:1]
    reducer = sc.GradientReducer("topk(ratio=1.0)+raw+fp32+allgather")
    try:
        reducer.allreduce_(named)
    except sc.SparseCommError as err:
        return {"error": str(err)}
    return {"a": a[0].item(), "b": b[0].item()}


def test_tensors_passed_in_another_order_are_matched_by_name():
    for result in run_local(2, named_in_different_orders, "order"):
        assert result == {"a": 1.5, "b": 15.0}


def test_a_rank_passing_fewer_tensors_fails_on_every_rank_naming_them():
    for result in run_local(2, named_in_different_orders, "count", timeout=60):
        assert "different tensors" in result["error"] and "'gradients a" in result["error"]


def keyed_calls(rank: int, world: int) -> str:
    reducer = sc.GradientReducer("allgather")
    try:
        reducer.reduce("first" if rank == 0 else "second", torch.ones(5000))
    except sc.SparseCommError as err:
        return str(err)
    return "summed"


def test_ranks_reducing_different_keys_fail_with_the_key_instead_of_summing_crosswise():
    messages = run_local(2, keyed_calls, timeout=60)
    assert "'first'" in messages[0] and "'second'" in messages[1]
    assert all("different tensors" in message for message in messages)


def nan_in_a_ddp_step(rank: int, world: int) -> str:
    model = DDP(mlp(0))
    model.register_comm_hook(sc.GradientReducer("dgc", model=model), sc.ddp_comm_hook)
    data, labels = next(batches(rank, world, 1))
    if rank == 1:
        data = data * float("nan")
    try:
        F.cross_entropy(model(data), labels).backward()
    except sc.SparseCommError as err:
        return f"SparseCommError: {err}"
    except Exception as err:  # noqa: BLE001 - the test reports what came instead
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_an_error_inside_the_ddp_hook_reaches_the_caller_as_a_sparsecomm_error():
    for message in run_local(2, nan_in_a_ddp_step, timeout=60):
        assert message.startswith("SparseCommError:") and "non-finite" in message, message


def reducer_without_a_model(rank: int, world: int) -> str:
    model = DDP(mlp(0))
    model.register_comm_hook(sc.GradientReducer("dgc"), sc.ddp_comm_hook)
    data, labels = next(batches(rank, world, 1))
    try:
        F.cross_entropy(model(data), labels).backward()
    except sc.SparseCommError as err:
        return str(err)
    return "no error"


def test_a_hook_state_without_parameter_names_is_refused_clearly():
    assert all("needs model=" in message for message in run_local(2, reducer_without_a_model, timeout=60))


def arguments_that_differ_from_the_state(rank: int, world: int) -> list[str]:
    grads = [("w", torch.randn(5000))]
    state = sc.allreduce_gradients(grads, "topk(ratio=0.1)+residual+rice+fp32+allgather", seed=1)
    messages = []
    for spec, seed in (("dense", 1), ("topk(ratio=0.1)+residual+rice+fp32+allgather", 2)):
        try:
            sc.allreduce_gradients(grads, spec, state, seed=seed)
            messages.append("ignored")
        except sc.SparseCommError as err:
            messages.append(str(err))
    sc.allreduce_gradients(grads, "topk(ratio=0.1)+residual+rice+fp32+allgather", state, seed=1)  # the same: fine
    return messages


def test_a_passed_state_built_with_other_arguments_raises_instead_of_ignoring_them():
    for messages in run_local(2, arguments_that_differ_from_the_state):
        assert all("build a new reducer" in message for message in messages), messages


def reducer_threads(rank: int, world: int) -> dict:
    def workers() -> int:
        return sum(t.name.startswith("sparsecomm-transport") and t.is_alive() for t in threading.enumerate())

    with sc.GradientReducer("topk(ratio=0.1)+residual+rice+fp32+auto(explore=1)") as reducer:
        for _ in range(3):  # a step's last call runs on the caller's thread; the first on the worker's
            reducer.allreduce_([("v", torch.randn(5000)), ("w", torch.randn(5000))])
        during = workers()
        saved = reducer.state_dict()
    return {"during": during, "after": workers(), "tunings": len(saved["session"]["tunings"])}


def test_the_reducer_owns_its_worker_thread_and_auto_measurements_and_releases_them():
    for result in run_local(2, reducer_threads):
        assert result == {"during": 1, "after": 0, "tunings": 1}


def test_no_module_level_mutable_state_and_no_global_statements():
    stateful_folders = ("transport", "reducer", "paths", "adaptive", "train")
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(node, ast.Global) for node in ast.walk(tree)), f"`global` in {path}"
        if path.parent.name not in stateful_folders and path.name != "pipeline.py":
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                mutable = isinstance(node.value, ast.Dict | ast.List | ast.Set) or (
                    isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") in ("dict", "list", "set"))
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                assert not (mutable and private), f"{path.name}: {private}"


def warnings_under_find_unused_parameters(rank: int, world: int) -> list[bool]:
    """Whether a reducer warns of DDP's ``find_unused_parameters``, with and without feedback."""
    import warnings

    warned = []
    for spec, find_unused in (("dgc", True), ("topk(ratio=0.05)+none+raw+fp32", True), ("dgc", False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = DDP(mlp(0), find_unused_parameters=find_unused)
            sc.register_ddp_hook(model, spec).close()
        warned.append(any("find_unused_parameters" in str(warning.message) and warning.filename == __file__
                          for warning in caught))  # pointing at the user's line
    return warned


def test_ddp_finding_unused_parameters_is_warned_of_where_feedback_would_lose_what_it_sent():
    assert run_local(2, warnings_under_find_unused_parameters) == [[True, False, False]] * 2
