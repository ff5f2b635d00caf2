"""A ``transformers`` causal LM as the trained model (``[model] arch = "hf"``), and the Hugging Face
config of the built-in Llama (for ``opendiloco export``).

Three ways to name one, all offline (nothing is downloaded):

- ``pretrained``: a local directory of a pretrained model; its weights are loaded;
- ``config_path``: a local ``config.json`` (or its directory): that architecture, new weights;
- ``model_type``: a ``transformers`` model type with its default config: new weights.

``options`` replace settings of the config (a setting the config does not have is refused: a typo
would otherwise be kept as a new attribute and ignored). New weights are drawn from
``[model] init_seed``, so every worker of a swarm starts from the same ones.
"""

from __future__ import annotations

import difflib
import json
import logging
from pathlib import Path

import torch

from ..extras import install_hint
from .config import ModelConfig
from .seeding import seeded
from .tokenizer import padded_vocab

log = logging.getLogger(__name__)


class ModelError(ValueError):
    """A model that cannot be built from the config; ``str()`` is one line naming the key."""


def _transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - a dependency; the message is for a broken install
        raise ModelError(f"[model] arch = \"hf\" needs transformers: {install_hint('hf')}") from None
    return transformers


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0][:300] if text else "") or type(e).__name__


def _local_dir(path: str, key: str, *, file_ok: bool = False) -> Path:
    p = Path(path).expanduser()
    if file_ok and p.is_file():
        return p
    if not p.is_dir():
        raise ModelError(f"model.{key}: {path} is not a directory{' or a file' if file_ok else ''}")
    if not (p / "config.json").is_file():
        raise ModelError(f"model.{key}: {path} holds no config.json (a Hugging Face model directory has one)")
    return p


def _read_json(path: Path, key: str) -> dict:
    file = path if path.is_file() else path / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"model.{key}: cannot read {file}: {_first_line(e)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelError(f"model.{key}: {file} names no model_type (not a transformers config)")
    return data


def hf_config(cfg: ModelConfig, *, vocab_size: int | None = None, seq_len: int | None = None,
              special_ids: dict[str, int | None] | None = None):
    """The ``transformers`` config ``cfg`` names, with its ``options`` applied; raises ``ModelError``.

    ``vocab_size``, ``special_ids`` (the tokenizer's): a config by ``model_type`` takes them unless
    ``options`` sets them; every config is checked to hold the tokenizer's ids and ``seq_len`` positions.
    """
    transformers = _transformers()
    if cfg.pretrained is not None:
        key, base = "pretrained", _read_json(_local_dir(cfg.pretrained, "pretrained"), "pretrained")
    elif cfg.config_path is not None:
        key, base = "config_path", _read_json(_local_dir(cfg.config_path, "config_path", file_ok=True), "config_path")
    else:
        key, base = "model_type", {"model_type": cfg.model_type}
    model_type = base["model_type"]
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise ModelError(f"model.{key}: {model_type!r} is not a model type transformers {transformers.__version__} "
                         "knows (e.g. llama, gpt2, qwen3, mixtral)") from None
    known = set(config_class().to_dict()) | set(base)
    for name in cfg.options:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            raise ModelError(f"model.options.{name}: {model_type}'s config has no such setting{hint}")
    extra: dict = {}
    if key == "model_type":  # a default config: the tokenizer's vocabulary and special tokens

        if vocab_size is not None:
            extra["vocab_size"] = padded_vocab(vocab_size)
        extra.update(special_ids or {})
    try:
        # One construction from all the settings: a config's own checks see them together.
        config = config_class.from_dict({**base, **extra, **cfg.options, "use_cache": False})
    except (ValueError, TypeError, KeyError) as e:
        raise ModelError(f"model.{key}: not a valid {model_type} config: {_first_line(e)}") from None
    _check_fits(config, vocab_size, seq_len)
    return config


def _check_fits(config, vocab_size: int | None, seq_len: int | None) -> None:
    have = getattr(config, "vocab_size", None)
    if vocab_size is not None and isinstance(have, int) and have < vocab_size:
        raise ModelError(f"model: the model's vocab_size {have} is smaller than the tokenizer's {vocab_size} "
                         "(data.tokenizer; or set model.options.vocab_size)")
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if seq_len is not None and isinstance(positions, int) and positions < seq_len:
        raise ModelError(f"model: the model takes at most {positions} positions, data.seq_len is {seq_len}")


def build_hf_model(cfg: ModelConfig, *, vocab_size: int, seq_len: int,
                   special_ids: dict[str, int | None] | None = None) -> torch.nn.Module:
    """The model in fp32 and training mode: the pretrained weights, or new ones drawn from ``cfg.init_seed``."""
    transformers = _transformers()
    config = hf_config(cfg, vocab_size=vocab_size, seq_len=seq_len, special_ids=special_ids)
    try:
        if cfg.pretrained is not None:
            model, loading = transformers.AutoModelForCausalLM.from_pretrained(
                cfg.pretrained, config=config, local_files_only=True, output_loading_info=True)
            missing = sorted(loading.get("missing_keys") or [])
            if missing:  # transformers would draw them at random and only warn
                raise ModelError(f"model.pretrained: {cfg.pretrained} lacks {len(missing)} of the model's weights "
                                 f"(e.g. {missing[0]})")
        else:
            with seeded(cfg.init_seed):
                model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelError(f"model: cannot build a causal LM of type {config.model_type!r}: {_first_line(e)}") from None
    return model.float().train()


def llama_hf_config(cfg: ModelConfig, *, vocab_size: int, seq_len: int, special_ids: dict[str, int | None]):
    """The ``transformers.LlamaConfig`` of the built-in Llama of ``cfg`` (its parameter names are
    ``LlamaForCausalLM``'s: a state dict moves between the two as it is)."""
    transformers = _transformers()
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads, max_position_embeddings=seq_len,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings, **special_ids)
