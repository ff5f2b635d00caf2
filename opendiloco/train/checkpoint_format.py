"""What a trainer's checkpoint holds, how it is made from the trainer's parts, and how it is checked
and loaded back into them. (How it is written and found on disk: ``checkpoint.py``.)

A checkpoint is a dict of tensors and plain values (``torch.load(weights_only=True)`` reads it):

- ``version``: 2;
- ``model``: θ_local, the model's state dict;
- ``optimizer``: ``DiLoCoOptimizer.state_dict()`` (inner and outer state, counters), except that
  θ_global is ``None`` for each tensor listed in ``global_params_from_model``: there its bytes equal
  θ_local's, so it is stored once. After a whole-model outer step that is every tensor of an fp32
  model: 16 bytes per parameter (weights, two AdamW moments, outer momentum), not 20;
- ``scheduler``, ``data`` (the stream's position), ``scaler`` (fp16 only, else ``None``);
- ``rng``: this process's random generators (``rng_state``);
- ``config``: the run's config as a dict (to say which model setting differs when shapes do not match);
- ``global_names``: the name (in ``model``) of each tensor of θ_global, in its order, and ``hf_config``:
  a ``transformers`` model's resolved config (JSON), or None. With them θ_global is read without
  this project (``torch.load`` alone; docs/models.md) and exported (``export.py``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from opendiloco import DiLoCoOptimizer

    from .config import Config
    from .data import PackedStream

VERSION = 2
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "data", "rng")
"""What every checkpoint holds (a file without them is not a checkpoint of this trainer)."""


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit this config's model or optimizer; ``str()`` is one line for the user."""


def make_checkpoint(*, model: torch.nn.Module, opt: DiLoCoOptimizer, scheduler, stream: PackedStream,
                    scaler: torch.amp.GradScaler | None, cfg: Config) -> dict:
    """What resume needs, once: θ_local, the inner and outer optimizer state, θ_global only for tensors
    where it differs from θ_local, counters, data position, RNG (the module's docstring)."""
    optimizer = opt.state_dict()
    outer = optimizer["outer"]
    same = [i for i, (p, g) in enumerate(zip(opt.outer.params, outer["global_params"]))
            if same_bits(p.detach().to("cpu", torch.float32), g)]
    if same:
        kept = set(same)
        outer = {**outer, "global_params": [None if i in kept else g for i, g in enumerate(outer["global_params"])]}
        optimizer = {**optimizer, "outer": outer}
    return {
        "version": VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer,
        "global_params_from_model": same,
        "scheduler": scheduler.state_dict(),
        "data": stream.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rng_state(),
        "config": cfg.model_dump(),
        "global_names": global_names(model, opt),
        "hf_config": model.config.to_json_string() if hasattr(getattr(model, "config", None), "to_json_string")
        else None,
    }


def global_names(model: torch.nn.Module, opt: DiLoCoOptimizer) -> list[str]:
    """The name in ``model.state_dict()`` of each of θ_global's tensors, in its order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in opt.outer.params]


def load_checkpoint(ckpt: dict, *, model: torch.nn.Module, opt: DiLoCoOptimizer, scheduler,
                    stream: PackedStream, scaler: torch.amp.GradScaler | None, path: Path) -> None:
    """Loads ``ckpt`` (read from ``path``) into the trainer's parts and this process's random generators;
    raises ``CheckpointMismatch`` (one line) if it does not fit them."""
    try:
        model.load_state_dict(ckpt["model"])
        optimizer = ckpt["optimizer"]
        from_model = ckpt.get("global_params_from_model") or []
        if from_model:  # θ_global was θ_local there: rebuilt from the weights just loaded
            glob = list(optimizer["outer"]["global_params"])
            for i in from_model:
                glob[i] = opt.outer.params[i].detach().to("cpu", torch.float32, copy=True)
            optimizer = {**optimizer, "outer": {**optimizer["outer"], "global_params": glob}}
        opt.load_state_dict(optimizer)
        scheduler.load_state_dict(ckpt["scheduler"])
        stream.load_state_dict(ckpt["data"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        set_rng_state(ckpt["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointMismatch(f"checkpoint {path} does not fit this config ({type(e).__name__}: {first})") from None


def check_model_fits(ckpt: dict, model: torch.nn.Module, cfg: Config, path: Path) -> None:
    """Raises ``CheckpointMismatch`` (one line) if the checkpoint's weights are not shaped like ``model``'s."""
    mine = model.state_dict()
    theirs = ckpt["model"] if isinstance(ckpt.get("model"), dict) else {}
    problem = next((f"{k} is {tuple(theirs[k].shape)} there, {tuple(t.shape)} here" for k, t in mine.items()
                    if k in theirs and hasattr(theirs[k], "shape") and theirs[k].shape != t.shape), None)
    if problem is None and theirs.keys() != mine.keys():
        missing, extra = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
        problem = (f"{len(missing)} tensor(s) missing there (e.g. {missing[0]})" if missing
                   else f"{len(extra)} tensor(s) unknown here (e.g. {extra[0]})")
    if problem is None:
        return
    saved = (ckpt.get("config") or {}).get("model") or {}
    ours = cfg.model.model_dump()
    differ = [f"model.{k} = {saved[k]!r} there, {ours[k]!r} here" for k in ours if k in saved and saved[k] != ours[k]]
    raise CheckpointMismatch(f"checkpoint {path} holds a model of another shape ({'; '.join(differ) or problem}): "
                             "resume with the model settings it was written with, or start a new run dir")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (``torch.equal`` calls -0.0 and +0.0 equal; θ_global's fingerprint does not)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def rng_state() -> dict:
    """This process's random generators: torch's, Python's, and its own CUDA device's."""
    state = {"torch": torch.random.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        # This process's device only: a checkpoint may resume on another number of GPUs.
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restores what ``rng_state`` returned (or an older checkpoint's one state per visible device)."""
    torch.random.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"])
    elif state.get("cuda"):  # older checkpoints: one state per visible device
        states = state["cuda"]
        torch.cuda.set_rng_state(states[min(torch.cuda.current_device(), len(states) - 1)])


def _tuples(x):
    """Python's random state is nested tuples; a checkpoint round trip may turn them into lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
