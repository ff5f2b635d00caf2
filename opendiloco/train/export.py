"""``opendiloco export``: θ_global of a run, as a Hugging Face model directory.

The directory holds ``config.json``, ``model.safetensors`` (fp32), ``generation_config.json`` and,
where the run used a Hugging Face tokenizer, that tokenizer: ``AutoModelForCausalLM.from_pretrained``
loads it, and its logits are those of θ_global in the worker (``tests/test_export.py`` measures it).
The built-in Llama is written as a ``transformers`` ``LlamaForCausalLM`` (its parameter names are
that model's). θ_global is read from the newest intact checkpoint of a run dir, or from a named
checkpoint file; nothing of the run is changed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from .checkpoint import CheckpointManager
from .config import Config, ConfigError, validate_config
from .hf_model import ModelError, hf_config, llama_hf_config
from .seeding import seeded
from .tokenizer import ByteTokenizer, special_ids


class ExportError(RuntimeError):
    """An export that cannot be done; ``str()`` is one line for the user."""


def read_checkpoint(source: Path) -> tuple[Path, dict]:
    """The checkpoint ``source`` names (a file), or the newest intact one of a run dir."""
    source = Path(source)
    if source.is_file():
        candidates = [source]
    elif source.is_dir():
        candidates = CheckpointManager(source).candidates()
        if not candidates:
            raise ExportError(f"{source} holds no checkpoints (a worker's run dir has a checkpoints/ folder)")
    else:
        raise ExportError(f"{source}: no such run dir or checkpoint file")
    problems = []
    for path in candidates:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, corrupt, not a torch file: try the previous one
            problems.append(f"{path.name}: {(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}")
            continue
        if isinstance(ckpt, dict) and "model" in ckpt and "optimizer" in ckpt:
            return path, ckpt
        problems.append(f"{path.name}: not a checkpoint of this trainer")
    raise ExportError("no readable checkpoint: " + "; ".join(problems))


def global_weights(ckpt: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """θ_global as a state dict: the checkpoint's model (θ_local and buffers) with each trainable tensor
    replaced by θ_global's, where it is stored apart (elsewhere the two are the same bits)."""
    weights = dict(ckpt["model"])
    glob = ckpt["optimizer"]["outer"]["global_params"]
    if len(glob) != len(names):
        raise ExportError(f"the checkpoint's θ_global has {len(glob)} tensors, its model {len(names)} trainable ones")
    for name, g in zip(names, glob):
        if g is not None:
            weights[name] = g.to(weights[name].dtype)
    return weights


def _config(ckpt: dict, path: Path) -> Config:
    try:
        return validate_config(ckpt.get("config") or {})
    except ConfigError as e:
        raise ExportError(f"checkpoint {path}: its config is not one this version reads ({e})") from None


def _tokenizer(cfg: Config):
    """The run's tokenizer (for its special ids, and to write beside the model), or None if it cannot be
    loaded (offline, say)."""
    if cfg.data.tokenizer == "bytes":
        return ByteTokenizer()
    from .tokenizer import make_tokenizer

    try:
        return make_tokenizer(cfg.data.tokenizer)
    except (RuntimeError, OSError, ValueError):
        return None


def build_for_export(ckpt: dict, path: Path):
    """A ``transformers`` causal LM holding the checkpoint's θ_global (fp32, eval mode), and the
    run's tokenizer (or None)."""
    import transformers

    cfg = _config(ckpt, path)
    tok = _tokenizer(cfg)
    ids = special_ids(tok) if tok is not None else {}
    try:
        if cfg.model.arch == "llama":
            vocab = int(ckpt["model"]["model.embed_tokens.weight"].shape[0])
            config = llama_hf_config(cfg.model, vocab_size=vocab, seq_len=cfg.data.seq_len, special_ids=ids)
        elif ckpt.get("hf_config"):
            saved = json.loads(ckpt["hf_config"])
            config = transformers.CONFIG_MAPPING[saved["model_type"]].from_dict(saved)
        else:
            if tok is None:
                raise ExportError(f"cannot load the run's tokenizer {cfg.data.tokenizer!r} to rebuild its model")
            config = hf_config(cfg.model, vocab_size=tok.vocab_size, special_ids=ids)
        config.use_cache = True  # trained without the cache; generation wants it
        with seeded(0):  # weights replaced below; the caller's generator left as it was
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ModelError, ValueError, KeyError) as e:
        raise ExportError(f"checkpoint {path}: cannot build its model: {e}") from None
    names = ckpt.get("global_names") or [n for n, p in model.named_parameters() if p.requires_grad]
    weights = global_weights(ckpt, names)
    # A tied head is one tensor under two names; θ_global names it once: load each tensor by that name.
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    try:
        missing, unexpected = model.load_state_dict({k: v for k, v in weights.items() if k in own}, strict=False)
        missing = [k for k in missing if k in own]
        unexpected = sorted(set(weights) - set(model.state_dict()))
        if missing or unexpected:
            raise RuntimeError(f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ExportError(f"checkpoint {path}: its weights do not fit a {type(model).__name__} "
                          f"({' '.join(first[:2])[:300]})") from None
    return model.float().eval(), tok, cfg


def export(source: Path, out: Path, *, overwrite: bool = False) -> dict:
    """Writes θ_global of ``source`` (a run dir or checkpoint file) to the new directory ``out``; returns
    what was written (``path``, ``checkpoint``, ``inner_step``, ``outer_step``, ``tokenizer``)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ExportError(f"{out} already exists and is not empty; choose a new directory (or --overwrite)")
    path, ckpt = read_checkpoint(source)
    model, tok, cfg = build_for_export(ckpt, path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target, then moved into place: a failed export leaves no half directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # one small file: no bar
        model.save_pretrained(tmp)
        tokenizer = None
        if tok is not None and hasattr(tok, "tok"):  # a Hugging Face tokenizer
            tok.tok.save_pretrained(tmp)
            tokenizer = cfg.data.tokenizer
        info = {"checkpoint": str(path), "inner_step": ckpt["optimizer"].get("inner_steps_total"),
                "outer_step": ckpt["optimizer"].get("outer_step"), "tokenizer": tokenizer or cfg.data.tokenizer}
        (tmp / "opendiloco.json").write_text(json.dumps(info, indent=2) + "\n")
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": out, **info, "tokenizer_written": tokenizer is not None}
