"""The workloads beyond digits: gpt, a GPT over the standard library's source bytes — its size, its
data, its causal attention, and AdamW training it — and cnn, a ResNet with batch normalisation
whose ranks keep their own statistics and average them to evaluate; and the update rules every
workload takes or refuses clearly."""

from types import SimpleNamespace

import pytest
import torch

from sparsecomm.errors import SparseCommError
from sparsecomm.launch import run_local
from sparsecomm.train.baselines import BASELINES
from sparsecomm.train.runner import average_buffers, ddp_options
from sparsecomm.train.update_rule import UpdateRule
from sparsecomm.train.workloads import workload


@pytest.fixture(scope="module")
def gpt():
    return workload("gpt")


def test_the_cpu_size_has_about_two_million_parameters_in_a_hundred_tensors(gpt):
    model = gpt.model(0)
    parameters = list(model.parameters())
    assert len(parameters) == 100 and 1.9e6 < sum(p.numel() for p in parameters) < 2.2e6
    assert model.tokens.weight.shape == (256, 144)  # bytes are the tokens
    large = workload("gpt-large").model(0)
    assert sum(p.numel() for p in large.parameters()) > 50e6


def test_the_model_is_seeded_and_leaves_the_callers_random_state_alone(gpt):
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    first, second = gpt.model(0), gpt.model(0)
    assert torch.rand(1) == before
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))
    assert not torch.equal(first.tokens.weight, gpt.model(1).tokens.weight)


def test_held_out_text_is_every_tenth_block_and_never_trained_on(gpt):
    from sparsecomm.train.gpt import _stdlib_source

    text = torch.frombuffer(bytearray(_stdlib_source(4_000_000)), dtype=torch.uint8)
    block = gpt.BLOCK
    blocks = len(text) // block
    assert len(gpt.test_tokens) == blocks // 10 * block and len(gpt.train_tokens) == (blocks - blocks // 10) * block
    assert torch.equal(gpt.train_tokens[: 9 * block], text[: 9 * block])
    assert torch.equal(gpt.test_tokens[:block], text[9 * block : 10 * block])
    assert torch.equal(gpt.train_tokens[9 * block : 10 * block], text[10 * block : 11 * block])


def test_batches_are_next_byte_targets_drawn_alike_for_a_seed_and_rank(gpt):
    first = list(gpt.batches(rank=1, world=2, steps=3, batch=4, seed=7))
    again = list(gpt.batches(rank=1, world=2, steps=3, batch=4, seed=7))
    other_rank = next(iter(gpt.batches(rank=0, world=2, steps=1, batch=4, seed=7)))
    for (inputs, targets), (inputs2, _) in zip(first, again, strict=True):
        assert inputs.shape == targets.shape == (4, 64)
        assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(inputs, inputs2)
    assert not torch.equal(first[0][0], other_rank[0])


def test_a_position_sees_no_later_byte(gpt):
    model = gpt.model(0).eval()
    inputs, _ = next(iter(gpt.batches(0, 1, 1, 2, 0)))
    changed = inputs.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(inputs)[:, :40], model(changed)[:, :40], atol=1e-5)
        assert not torch.allclose(model(inputs)[:, 40:], model(changed)[:, 40:])


def test_adamw_lowers_the_held_out_perplexity_in_a_few_steps(gpt):
    model = gpt.model(0)
    before = gpt.evaluate(model)
    assert 30 < before.metric < 300  # near a uniform guess over 256 bytes at the start
    optimizer, suited = UpdateRule.of(gpt).build(model, None)
    assert isinstance(optimizer, torch.optim.AdamW) and suited is None
    for batch in gpt.batches(0, 1, 30, 8, 0):
        optimizer.zero_grad()
        gpt.loss(model, batch).backward()
        optimizer.step()
    assert gpt.evaluate(model).metric < 0.7 * before.metric


def test_each_workload_has_its_own_update_rule_and_refuses_one_it_cannot_take():
    digits = workload("digits")
    assert UpdateRule.of(digits) == UpdateRule("sgd", 0.05)
    assert UpdateRule.of(digits, "adamw") == UpdateRule("adamw", 1e-3)
    assert UpdateRule.of(digits, "adamw", lr=0.01).lr == 0.01
    sparse = SimpleNamespace(name="lm", optimizer="sgd", learning_rates={"sgd": 0.1},
                             model=lambda seed: torch.nn.Embedding(10, 2, sparse=True))  # as lm's model is
    with pytest.raises(SparseCommError, match="sparse gradients, which PyTorch's AdamW does not take"):
        UpdateRule.of(sparse, "adamw")
    with pytest.raises(SparseCommError, match="no default learning rate for gpt under sgd: pass --lr"):
        UpdateRule.of(workload("gpt"), "sgd")
    with pytest.raises(SparseCommError, match="unknown optimizer 'lamb'"):
        UpdateRule.of(digits, "lamb")


def test_the_gpt_warms_its_learning_rate_up_then_decays_it_and_the_others_keep_it_constant():
    model = torch.nn.Linear(4, 2)
    rule = UpdateRule.of(workload("gpt"))
    optimizer, _ = rule.build(model, None)
    schedule = rule.schedule(optimizer, 100)
    rates = []
    for _ in range(100):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)  # 10 steps of warm-up
    assert rates[10:] == sorted(rates[10:], reverse=True) and rates[-1] == pytest.approx(1e-4, rel=0.01)
    assert "warm-up over 10% of the steps" in rule.describe()
    assert UpdateRule.of(workload("digits")).schedule(optimizer, 100) is None


def test_sgd_leaves_the_momentum_to_a_pipeline_that_corrects_it_itself():
    model = torch.nn.Linear(4, 2)
    optimizer, _ = UpdateRule("sgd", 0.1).build(model, None)
    assert optimizer.param_groups[0]["momentum"] == 0.9 and optimizer.param_groups[0]["nesterov"]


def test_the_cnn_normalises_every_convolution_and_evaluates_with_running_statistics():
    cnn = workload("cnn")
    model = cnn.model(0)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(norms) == len(convolutions) == 10 and len(list(model.parameters())) == 32
    images, labels = next(iter(cnn.batches(0, 2, 1, 16, 0)))
    assert images.shape == (16, 64) and labels.shape == (16,)  # the digits workload's, as 1x8x8 in the model
    cnn.loss(model, (images, labels)).backward()  # a training step moves the running statistics
    before = norms[0].running_mean.clone()
    first = cnn.evaluate(model)
    assert model.training and torch.equal(norms[0].running_mean, before)  # evaluation changes nothing
    assert first == cnn.evaluate(model) and 0 <= first.metric <= 100


def test_each_workload_builds_its_ddp_rows_with_its_own_options():
    cnn = ddp_options(workload("cnn"))  # statistics averaged at the end; the name as this PyTorch has it
    assert cnn in ({"broadcast_buffers": False}, {"forward_sync_buffers": False})
    assert ddp_options(workload("gpt")) == {"bucket_cap_mb": 2.0}
    assert ddp_options(workload("digits")) == {}  # PyTorch's defaults


def _statistics_kept_apart_then_averaged(rank: int, world: int) -> dict:
    cnn = workload("cnn")
    wrapped = {row: BASELINES[row].wrap(cnn.model(0), ddp_options(cnn))[0]
               for row in ("torch-allreduce", "torch-powersgd-r2")}
    model = wrapped["torch-allreduce"]
    images, labels = next(iter(cnn.batches(rank, world, 1, 16, 0)))
    cnn.loss(model, (images, labels)).backward()  # each rank's own images move its own statistics
    norm = next(m for m in model.module.modules() if isinstance(m, torch.nn.BatchNorm2d))
    before = (norm.running_mean.clone(), norm.running_var.clone(), norm.num_batches_tracked.clone())
    average_buffers(model)
    return {"broadcast": [m.will_sync_module_buffers() for m in wrapped.values()], "before": before,
            "after": (norm.running_mean, norm.running_var, norm.num_batches_tracked)}


def test_a_cnn_row_keeps_each_ranks_statistics_and_evaluates_their_mean():
    first, second = run_local(2, _statistics_kept_apart_then_averaged)
    assert first["broadcast"] == second["broadcast"] == [False, False]  # PowerSGD's one bucket keeps it
    assert not torch.equal(first["before"][0], second["before"][0])  # not broadcast: the ranks differ
    for index in (0, 1):  # mean and variance: the ranks' mean, alike on both
        torch.testing.assert_close(first["after"][index], (first["before"][index] + second["before"][index]) / 2)
        assert torch.equal(first["after"][index], second["after"][index])
    assert first["after"][2] == first["before"][2] == 1  # the step count is no statistic: left as it is
