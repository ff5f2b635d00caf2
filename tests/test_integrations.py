"""The integrations' pieces without a swarm: what they build, and how a missing framework is said."""

from __future__ import annotations

import functools

import pytest
import torch

from opendiloco import DiLoCoOptimizer
from opendiloco.extras import DISTRIBUTION, require
from opendiloco.integrations import RoundLog


def test_a_missing_framework_is_one_line_naming_the_extra():
    with pytest.raises(ImportError) as raised:
        require("no_such_framework_here", "lightning", "opendiloco.integrations.lightning")
    said = str(raised.value)
    assert "\n" not in said and f"pip install '{DISTRIBUTION}[lightning]'" in said, said


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2))


def test_the_hf_callback_builds_the_inner_optimizer_the_training_arguments_name(tmp_path):
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from opendiloco.integrations.hf import DiLoCoCallback

    model = tiny_llama()
    args = TrainingArguments(str(tmp_path), learning_rate=3e-3, weight_decay=0.05, adam_beta2=0.95, optim="adamw_torch",
                             report_to="none", use_cpu=True)
    opt, scheduler = DiLoCoCallback(local_steps=7).optimizers(model, args)
    assert isinstance(opt, DiLoCoOptimizer) and scheduler is None and opt.local_steps == 7
    assert isinstance(opt.inner, torch.optim.AdamW)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.05 and plain["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim < 2 for p in plain["params"])
    assert all(g["lr"] == 3e-3 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_lightnings_around_keeps_the_built_optimizer_and_its_schedule():
    pytest.importorskip("lightning")
    from opendiloco.integrations.lightning import around

    model = torch.nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 0.5 ** step)
    opt = around(inner, local_steps=2, communicator=None, module=model)
    assert opt.inner is inner and opt.param_groups is inner.param_groups
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    schedule.step()
    assert opt.param_groups[0]["lr"] == 0.5  # the schedule built on the inner optimizer drives DiLoCo's


def test_round_log_says_each_outer_step_once(caplog):
    model = torch.nn.Linear(4, 2)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, inner_optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    rounds = RoundLog(opt)
    landed = []
    with caplog.at_level("INFO", logger="opendiloco.integrations"):
        for _ in range(4):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            landed.append(rounds())
    assert [r.outer_step if r else None for r in landed] == [None, 1, None, 2]
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"outer step {r.outer_step}: θ_global {r.global_hash}, group of 1, {r.seconds:.2f} s"
                    for r in landed if r]
