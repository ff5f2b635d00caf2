"""The model: a randomly initialised Llama (``llama.py``: ``transformers``' parameter names and
initial weights, without its import), or a ``transformers`` causal LM (``hf_model.py``); nothing
downloaded."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .hf_model import build_hf_model
from .seeding import seeded
from .tokenizer import padded_vocab, special_ids


def build_model(cfg: ModelConfig, vocab_size: int, max_seq_len: int, tokenizer=None) -> torch.nn.Module:
    """The same weights on every worker: drawn from ``cfg.init_seed``, not from the trainer's RNG (or a
    pretrained model's). A model the config cannot build: ``hf_model.ModelError``, one line."""
    if cfg.arch == "hf":
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


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
