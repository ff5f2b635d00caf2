"""The project's Llama against ``transformers``' ``LlamaForCausalLM``: the same parameter names and
initial weights for the same seed, the same loss and gradients, state dicts that move both ways."""

from __future__ import annotations

import threading

import pytest
import torch

from opendiloco.train.config import ModelConfig
from opendiloco.train.llama import LlamaForCausalLM, LlamaSpec
from opendiloco.train.model import build_model
from opendiloco.train.seeding import seed_generators, seeded

transformers = pytest.importorskip("transformers")

def shape_id(shape: dict) -> str:
    return f"kv{shape['num_kv_heads']}" + ("-tied" if shape["tie_embeddings"] else "")


SHAPES = [dict(num_kv_heads=4, tie_embeddings=False), dict(num_kv_heads=2, tie_embeddings=False),
          dict(num_kv_heads=4, tie_embeddings=True), dict(num_kv_heads=1, tie_embeddings=True)]


def pair(seed: int, num_kv_heads: int, tie_embeddings: bool):
    spec = LlamaSpec(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=num_kv_heads, max_seq_len=24, rms_norm_eps=1e-5, rope_theta=500.0, init_std=0.03,
                     tie_embeddings=tie_embeddings)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, max_position_embeddings=24, rms_norm_eps=1e-5, rope_theta=500.0,
        initializer_range=0.03, tie_word_embeddings=tie_embeddings, use_cache=False)
    torch.manual_seed(seed)
    theirs = transformers.LlamaForCausalLM(config).float()
    torch.manual_seed(seed)
    return LlamaForCausalLM(spec), theirs


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_the_same_seed_draws_the_same_weights_under_the_same_names(shape):
    ours, theirs = pair(7, **shape)
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == shape["tie_embeddings"]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_the_same_weights_give_the_same_loss_and_gradients(shape):
    ours, theirs = pair(3, **shape)
    with torch.no_grad():  # weights that have trained a little: norms off 1, not just the initial draw
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours.load_state_dict(theirs.state_dict())
    batch = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    mine, other = ours(input_ids=batch, labels=batch), theirs(input_ids=batch, labels=batch)
    torch.testing.assert_close(mine.logits, other.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.loss, other.loss, rtol=1e-6, atol=1e-6)
    mine.loss.backward()
    other.loss.backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_state_dict_moves_both_ways_unchanged():
    ours, theirs = pair(11, num_kv_heads=2, tie_embeddings=False)
    fresh_ours, fresh_theirs = pair(12, num_kv_heads=2, tie_embeddings=False)
    fresh_ours.load_state_dict(theirs.state_dict(), strict=True)
    fresh_theirs.load_state_dict(ours.state_dict(), strict=True)
    assert all(torch.equal(p, q) for p, q in zip(fresh_ours.parameters(), theirs.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(fresh_theirs.parameters(), ours.parameters()))


def test_the_trainers_model_draws_from_its_seed_and_leaves_the_callers_rng_alone():
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, init_seed=5)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a, b = build_model(cfg, 100, 16), build_model(cfg, 100, 16)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    other = build_model(cfg.model_copy(update={"init_seed": 6}), 100, 16)
    assert not torch.equal(a.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert a.lm_head.weight.shape == (128, 32)  # the vocabulary padded to a multiple of 64


def test_a_trainer_seeding_in_another_thread_waits_until_a_model_is_drawn():
    """Workers in threads of one process: a trainer's ``seed_generators`` while another thread draws
    initial weights under ``seeded`` once reset those draws midway, and the replicas differed."""
    drawn, entered, resume = [], threading.Event(), threading.Event()

    def draw():
        with seeded(1):
            drawn.append(torch.rand(4))
            entered.set()
            resume.wait(10)
            drawn.append(torch.rand(4))

    drawer = threading.Thread(target=draw)
    drawer.start()
    assert entered.wait(10)
    seeder = threading.Thread(target=seed_generators, args=(5,))
    seeder.start()
    seeder.join(0.5)  # with no lock it has reset the generator by now
    resume.set()
    drawer.join(10)
    seeder.join(10)
    torch.manual_seed(1)
    assert torch.equal(drawn[1], torch.rand(8)[4:])


def test_ten_adamw_steps_of_both_stay_together():
    """What the convergence figures measured with ``transformers``' Llama rest on: the same training."""
    ours, theirs = pair(5, num_kv_heads=2, tie_embeddings=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        batch = torch.randint(0, 128, (4, 24), generator=g)
        losses = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-5, losses
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
