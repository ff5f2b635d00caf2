"""The model: a randomly initialised Llama (``llama.py``: ``transformers``' parameter names and
initial weights, without its import), or a ``transformers`` causal LM (``hf_model.py``); nothing
downloaded."""

from __future__ import annotations

import contextlib
import random
import threading

import torch

from .config import ModelConfig


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Rounds the embedding table up so its matmuls hit fast GPU shapes."""
    return -(-vocab_size // multiple) * multiple


def special_ids(tokenizer) -> dict[str, int | None]:
    """A tokenizer's special token ids, as a ``transformers`` config names them."""
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}


def build_model(cfg: ModelConfig, vocab_size: int, max_seq_len: int, tokenizer=None) -> torch.nn.Module:
    """The same weights on every worker: drawn from ``cfg.init_seed``, not from the trainer's RNG (or a
    pretrained model's). A model the config cannot build: ``hf_model.ModelError``, one line."""
    if cfg.arch == "hf":
        from .hf_model import build_hf_model

        return build_hf_model(cfg, vocab_size=vocab_size, seq_len=max_seq_len,
                              special_ids=special_ids(tokenizer) if tokenizer is not None else None)
    from .llama import LlamaForCausalLM, LlamaSpec

    spec = LlamaSpec(
        vocab_size=padded_vocab(vocab_size),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads or cfg.num_heads,
        max_seq_len=max_seq_len,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        init_std=cfg.init_std,
        tie_embeddings=cfg.tie_embeddings,
    )
    with seeded(cfg.init_seed):
        model = LlamaForCausalLM(spec)
    return model.float()


_SEEDED = threading.Lock()


def seed_generators(seed: int) -> None:
    """Seeds torch's and Python's generators, outside any ``seeded`` block: a trainer seeding them in one
    thread while another thread draws a model's initial weights would reset that model's draws midway."""
    with _SEEDED:
        torch.manual_seed(seed)
        random.seed(seed)


@contextlib.contextmanager
def seeded(seed: int):
    """torch's generator seeded with ``seed`` for the block, then put back as it was. One block at a
    time in a process: two models drawn at once (workers in threads) would interleave their draws."""
    with _SEEDED:
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.random.set_rng_state(rng_state)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
