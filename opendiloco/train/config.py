"""The trainer's configuration: typed sections, TOML loading, dotted command-line overrides.

Free of hivemind imports and of work, so that a bad config is refused within a second, before
any work starts.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import socket
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from opendiloco.comm.formats import get_codec
from opendiloco.streaming import check_schedule
from opendiloco.train.validation_errors import describe, in_one_line

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A config that cannot be used; ``str()`` is one line naming the offending key."""


INT_MAX = 2**63 - 1
"""Every integer must fit in 64 bits (torch and the DHT records take them as such)."""
SECONDS_MAX = 86400.0
"""A timeout or wait longer than a day is a typo; an infinite one overflows the event loop's timers."""
PART_NUMEL_BLOCK = 1024
"""``swarm.part_numel`` is a multiple of this: every codec's block."""
PART_NUMEL_MAX = 1 << 24
"""The largest ``swarm.part_numel``: 64 MiB per part even uncompressed (fp32)."""
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is one (what ``[swarm] run_id`` accepts), else ``ConfigError``."""
    if not isinstance(run_id, str) or not _ID.match(run_id):
        raise ConfigError(f"{run_id!r} is not a run id: 1 to 128 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit")
    return run_id
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


class Section(BaseModel):
    # allow_inf_nan=False: every float of the config must be finite (inf and nan are refused).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="after")
    def _plain_values(self):
        """Checked for every field of every section: integers fit in 64 bits, strings are not empty."""
        for name in type(self).model_fields:
            values = getattr(self, name)
            listed = values if isinstance(values, list) else list(values.values()) if isinstance(values, dict) \
                else [values]
            for v in listed:
                if isinstance(v, int) and not isinstance(v, bool) and not -INT_MAX <= v <= INT_MAX:
                    raise ValueError(f"{name}: {v} is out of range (at most {INT_MAX})")
                if isinstance(v, float) and not math.isfinite(v):  # a list item: not covered by allow_inf_nan
                    raise ValueError(f"{name}: must be a finite number, got {v!r}")
                if isinstance(v, str) and not v.strip():
                    raise ValueError(f"{name}: must not be empty")
        return self


def _check_name(v: str | None, what: str) -> str | None:
    """A name that becomes one directory of the run dir: no separators, not '.' or '..'."""
    if v is not None and ("/" in v or "\\" in v or v.strip() in (".", "..") or v != v.strip()):
        raise ValueError(f"{v!r} cannot be used as a {what} (no '/', no surrounding spaces, not '.' or '..')")
    return v


class RunConfig(Section):
    name: str | None = None
    """Run name; the default run dir is ``runs/<name or swarm.run_id>/<worker>``."""
    worker: str | None = None
    """This worker's name (default: the host name). Also the default data shard key."""
    dir: str | None = None
    progress: bool = True
    log_every: int = Field(10, ge=1)
    """Inner steps between ``train`` records in metrics.jsonl."""
    log_to: list[Literal["wandb", "tensorboard"]] = []
    """Also log the metrics to Weights & Biases and/or TensorBoard (extras: opendiloco-swarm[wandb], [tensorboard])."""
    wandb_project: str = "opendiloco"
    wandb_mode: Literal["online", "offline"] = "offline"
    """offline writes the run under the run dir (``wandb sync`` uploads it later); online needs a login."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve this worker's figures for Prometheus at ``http://metrics_host:metrics_port/metrics``
    (default: off; 0 takes a free port, written to the ``start`` record as ``metrics_url``)."""
    metrics_host: str = "127.0.0.1"
    """Where the metrics are served; another address (``0.0.0.0``) is the user's explicit choice."""

    @field_validator("name", "worker")
    @classmethod
    def _names(cls, v, info):
        return _check_name(v, f"run.{info.field_name}")


HF_MODEL_KEYS = ("pretrained", "config_path", "model_type")
"""The ``[model]`` keys that each name a ``transformers`` model (one at a time, with ``arch = "hf"``)."""


class ModelConfig(Section):
    arch: Literal["llama", "hf"] = "llama"
    """llama: the built-in Llama (the keys below); hf: a ``transformers`` causal LM, named by one of
    ``pretrained``, ``config_path`` or ``model_type`` (giving one of them implies ``hf``)."""
    pretrained: str | None = None
    """hf: a local directory of a pretrained model (``config.json`` and weights), loaded offline."""
    config_path: str | None = None
    """hf: a local ``config.json`` (or the directory holding one): its architecture, randomly initialised."""
    model_type: str | None = None
    """hf: a ``transformers`` model type (``gpt2``, ``qwen3``, ``mixtral``...), randomly initialised from
    its default config and ``options``."""
    options: dict[str, Any] = {}
    """hf: settings of the model's config that replace the ones it has (``[model.options]``)."""
    hidden_size: int = Field(256, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int | None = Field(None, ge=1)
    intermediate_size: int = Field(1024, ge=1)
    tie_embeddings: bool = False
    rms_norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    init_std: float = Field(0.02, gt=0)
    init_seed: int = Field(0, ge=0)
    """Every worker must start from the same weights: they are drawn from this seed."""

    @model_validator(mode="after")
    def _heads(self):
        named = [k for k in HF_MODEL_KEYS if getattr(self, k) is not None]
        if named and "arch" not in self.model_fields_set:
            self.arch = "hf"
        if self.arch == "hf":
            if len(named) != 1:
                raise ValueError("arch \"hf\" needs one of pretrained, config_path or model_type" if not named
                                 else f"{' and '.join(named)} both name a model; keep one")
            llama = sorted(k for k in _LLAMA_KEYS if getattr(self, k) != type(self).model_fields[k].default)
            if llama:
                raise ValueError(f"{llama[0]}: a setting of the built-in llama; a transformers model takes its "
                                 f"settings in [model.options]")
            return self
        if named or self.options:
            raise ValueError(f"{(named or ['options'])[0]}: names a transformers model, which needs arch = \"hf\"")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        return self


_LLAMA_KEYS = {"hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "tie_embeddings",
               "rms_norm_eps", "rope_theta", "init_std"}


class DataConfig(Section):
    source: Literal["stdlib", "files", "hf", "tokens"] = "stdlib"
    """stdlib: Python's own standard library sources (offline); files: local .txt/.jsonl; hf: a HF dataset;
    tokens: pre-tokenised token shards (.bin uint16 as nanoGPT writes them, or .npy)."""
    paths: list[str] = []
    """For source=files: .txt files (documents split at blank lines) or .jsonl files (a ``text`` field).
    For source=tokens: the token shards, read one after another."""
    eval_paths: list[str] = []
    """For source=tokens: shards to evaluate on; when unset, rows are held out by a fixed seed."""
    dataset: str | None = None
    """For source=hf: the dataset name, streamed (needs ``pip install 'opendiloco-swarm[data]'``)."""
    dataset_config: str | None = None
    split: str = "train"
    eval_split: str | None = None
    """For source=hf: a separate split for eval; when unset, documents are held out by hash."""
    text_field: str = "text"
    tokenizer: str = "bytes"
    """``bytes`` (UTF-8 bytes + specials, nothing to download) or a Hugging Face tokenizer name."""
    seq_len: int = Field(256, ge=2)
    eval_fraction: float = Field(0.02, ge=0, lt=1)
    """Share of documents held out for eval, chosen by a hash of each document's identity."""
    shard_seed: str | None = None
    """Key that picks this worker's part of the data (default: run.worker)."""
    rank: int | None = Field(None, ge=0)
    world_size: int | None = Field(None, ge=1)
    """Explicit disjoint sharding: this worker reads every world_size-th document from rank."""
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self):
        kinds = (".bin", ".npy") if self.source == "tokens" else (".txt", ".jsonl")
        for key in ("paths", "eval_paths"):
            for p in getattr(self, key):
                if not p.endswith(kinds):
                    raise ValueError(f"{key}: {p!r}: expected a {' or '.join(kinds)} file"
                                     + (" (token shards)" if self.source == "tokens" else ""))
        if self.eval_paths and self.source != "tokens":
            raise ValueError("eval_paths: for source 'tokens' (other sources: eval_fraction, eval_split)")
        if (self.rank is None) != (self.world_size is None):
            raise ValueError("rank and world_size must be given together")
        if self.rank is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        if self.source in ("files", "tokens") and not self.paths:
            raise ValueError(f"source '{self.source}' needs data.paths")
        if self.source == "hf" and not self.dataset:
            raise ValueError("source 'hf' needs data.dataset")
        return self


class OptimConfig(Section):
    local_steps: int = Field(500, ge=1)
    """H: inner steps between outer steps."""
    lr: float = Field(4e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: list[float] = [0.9, 0.95]
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)
    """Max gradient norm; 0 disables clipping."""
    outer_lr: float = Field(0.4, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    outer_nesterov: bool = True
    solo_outer_lr: float = Field(0.5, gt=0)
    solo_outer_momentum: float = Field(0.0, ge=0, lt=1)
    """The outer step of a worker that trains alone (no swarm), in place of outer_lr and
    outer_momentum: its pseudo-gradient is nobody's average, and momentum tuned for averages
    overshoots it. 0.5 without momentum is Lookahead's step (docs/benchmarks.md, "One worker")."""
    fragments: int = Field(1, ge=1)
    """Streaming DiLoCo: the model is cut into this many fragments that synchronise in turn, one
    every local_steps / fragments inner steps (1: the whole model at once)."""
    overlap: int = Field(0, ge=0)
    """Inner steps a fragment's round runs in the background before it is applied (tau; 0: blocking)."""
    mix: float = Field(0.0, ge=0, le=1)
    """Share of the local weights kept when a round lands (alpha; 0 takes theta_global)."""
    pace: Literal["fixed", "swarm"] = "swarm"
    """When a round is due. swarm: when the group has done local_steps steps' worth of work per
    member, so workers of different speed stop together and all contribute (a lone worker takes
    exactly local_steps). fixed: exactly local_steps inner steps per worker (reproducible)."""
    warm_start: bool = False
    """A joiner's inner AdamW starts from its donor's moments instead of empty ones (donors serve
    them: a state download three times the size). Off: measured no better (benchmarks/warm_start.py)."""
    inner: Literal["adamw", "muon"] = "adamw"
    """The inner optimizer. muon: Muon on the hidden weight matrices (its update scaled to AdamW's
    RMS, so ``lr`` and ``weight_decay`` serve both), AdamW on embeddings, head, norms and biases."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """Muon's (Nesterov) momentum, under ``inner = "muon"``."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        if len(v) != 2 or not all(0 <= b < 1 for b in v):
            raise ValueError(f"expected two numbers in [0, 1), got {v}")
        return v

    @model_validator(mode="after")
    def _schedule(self):
        check_schedule(self.local_steps, self.fragments, self.overlap, self.mix)
        if self.warm_start and self.inner != "adamw":
            raise ValueError("warm_start serves AdamW's moments: it needs inner = \"adamw\"")
        return self


class TrainConfig(Section):
    total_steps: int = Field(1000, ge=1)
    """Inner optimizer steps in the whole run (the lr schedule spans them)."""
    batch_size: int = Field(16, ge=1)
    grad_accum: int = Field(1, ge=1)
    device: str = "auto"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 autocast on CUDA, fp32 on CPU. fp16 adds a GradScaler (CUDA only)."""
    compile: bool = False
    threads: int = Field(0, ge=0)
    """torch CPU threads; 0 uses every core this process may run on."""
    eval_every: int = Field(0, ge=0)
    """Inner steps between evals; 0 evaluates after every outer step (every whole-model sync when streaming)."""
    eval_batches: int = Field(8, ge=0)
    seed: int = Field(0, ge=0)
    throttle: float = Field(0.0, ge=0, le=3600)
    """Seconds of sleep added to every inner step: makes this worker slower on purpose (to try a
    swarm of workers of different speed on one machine; benchmarks and tests use it)."""


class CheckpointConfig(Section):
    every_outer_steps: int = Field(1, ge=0)
    """0 writes a checkpoint only at the end (or when stopped)."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept: the newest, and one more in case the newest is lost with its disk."""
    background: bool = True
    """Write periodic checkpoints on a thread from a snapshot in host memory (the final one, at the
    end of a run or on a signal, is always written before the process exits)."""


def _check_maddr(addr: str, what: str) -> None:
    if not addr.startswith("/") or "//" in addr or len(addr.strip("/").split("/")) < 2:
        raise ValueError(f"{addr!r} is not a multiaddr like /ip4/1.2.3.4/tcp/31337 ({what})")


def _is_peer_id(text: str) -> bool:
    """A libp2p peer id as printed: a base58 multihash (identity ``00`` or sha2-256 ``12 20``)."""
    n = 0
    for c in text:
        if c not in _BASE58:
            return False
        n = n * 58 + _BASE58.index(c)
    raw = b"\0" * (len(text) - len(text.lstrip("1"))) + n.to_bytes((n.bit_length() + 7) // 8, "big")
    if len(raw) < 3 or raw[0] not in (0x00, 0x12) or raw[1] != len(raw) - 2:
        return False
    return raw[0] == 0x00 or raw[1] == 32


class SwarmConfig(Section):
    enabled: bool = False
    """Join a swarm; implied by initial_peers."""
    initial_peers: list[str] = []
    host_maddrs: list[str] = ["/ip4/0.0.0.0/tcp/0"]
    announce_maddrs: list[str] = []
    identity_path: str | None = None
    client_mode: bool = False
    run_id: str = "opendiloco"
    compression: str = "fp16"
    """The pseudo-gradients' wire format: none, fp16, scaled-fp16, int8, int4, e2m1 or e3m0; subsetN+ one of
    them (e.g. subset32+int4) sends a shared-seed 1/N of the values each round, with error feedback."""
    result_compression: str | None = None
    """The averaged shards' wire format (a wider one than compression's protects the average from a
    second rounding); unset: the same as compression."""
    error_feedback: bool | None = None
    """Add what the wire format lost of a contribution to the next one; unset: on for the 8- and
    4-bit formats and the subset formats (which cannot run without it)."""
    error_decay: float | None = Field(None, gt=0, le=1)
    """Top-k formats only (SparseLoCo's rule): θ_local restarts from θ_global after every round and what
    was not sent is owed in the residual, decayed by this each round; pair it with a plain outer step
    ([optim] outer_momentum = 0). Unset: the unsent keep their local progress."""
    min_group_size: int = Field(1, ge=1)
    matchmaking_timeout: float = Field(30.0, gt=0, le=SECONDS_MAX)
    allreduce_timeout: float = Field(60.0, gt=0, le=SECONDS_MAX)
    verify_timeout: float = Field(5.0, gt=0, le=SECONDS_MAX)
    """Seconds a member waits for the others' confirmations of the average's digest."""
    max_attempts: int = Field(3, ge=1, le=1000)
    """Attempts of one round (each with whoever is still there) before the outer step fails."""
    poll_interval: float = Field(0.02, ge=0.001, le=60.0)
    """Seconds between two looks at the DHT while a group forms (a peer's ring wakes a worker sooner)."""
    quiet_poll_interval: float = Field(0.25, ge=0.001, le=60.0)
    """The longest gap between two looks while no announcement changes (the gap doubles from
    ``poll_interval`` up to it, and is back at ``poll_interval`` once one does)."""
    part_numel: int = Field(1 << 18, ge=PART_NUMEL_BLOCK, le=PART_NUMEL_MAX)
    """Values per streamed part of a contribution, a multiple of 1024; workers group only with the
    same one, like compression."""
    straggler_wait: float = Field(10.0, ge=0, le=SECONDS_MAX)
    """Grace, in seconds, beyond the time a slower peer published it would be ready (or from the
    start of matchmaking for a peer that published none)."""
    max_wait: float = Field(600.0, gt=0, le=SECONDS_MAX)
    """The longest a round waits for a live peer that says it is coming."""
    join_timeout: float = Field(30.0, ge=0, le=SECONDS_MAX)
    on_join_failure: Literal["start-fresh", "exit"] = "start-fresh"
    weight_by_samples: bool = False
    aggregation: Literal["mean", "centered-clip"] = "mean"
    """How shard owners combine contributions (always with the two bounds below); centered-clip is
    the robust one."""
    clip_ratio: float = Field(4.0, ge=1)
    """A contribution's part is scaled down to at most this multiple of the group's median norm (inf: off)."""
    max_weight_ratio: float = Field(4.0, ge=1)
    """A claimed weight counts at most this multiple of the group's median weight (inf: off)."""
    audit_chunks: int = Field(4, ge=0, le=64)
    """Random chunks of every other shard owner's result each member checks per round, from the
    other members' values (0: owners are trusted); docs/trust.md."""
    exclude_rounds: int = Field(16, ge=0, le=1_000_000)
    """Outer steps for which a member caught sending malformed data is left out of this worker's
    groups (0: only for the retries of the round it was caught in); docs/trust.md."""
    partition_hold: float = Field(120.0, ge=0, le=SECONDS_MAX)
    """The longest, in seconds, a worker whose groups lack most of the workers it last averaged with
    (a partition, or most of them crashed) keeps its work instead of applying rounds apart from them
    (0: never: both sides of a partition go on, and the smaller one heals); docs/pacing.md."""
    cut_off_after: float = Field(15.0, ge=0, le=SECONDS_MAX)
    """Seconds a member of a round may hear nothing from any other member, while it waits on them,
    before it takes itself for cut off (its address changed): it abandons the attempt, dials anew and
    says so, and the others stop waiting for it (0: never; raise it on links that take longer for one
    part from each member); docs/pacing.md."""
    secret_file: str | None = None
    """A file holding the run secret: only workers started with it take part (a closed run). Unset:
    $OPENDILOCO_RUN_SECRET, else $OPENDILOCO_RUN_SECRET_FILE. The secret itself is never a config
    value (config.toml is written to the run dir)."""
    open: bool = False
    """Train in an open run, without a secret: anyone who can reach a worker can join the run, vote
    on its state, serve state and stall rounds. A swarm worker needs a run secret or this explicit
    choice (docs/trust.md)."""

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v):
        try:
            return check_run_id(v)
        except ConfigError as e:
            raise ValueError(str(e)) from None

    @field_validator("part_numel")
    @classmethod
    def _part_numel(cls, v):
        if v % PART_NUMEL_BLOCK:
            raise ValueError(f"must be a multiple of {PART_NUMEL_BLOCK} (every codec's block), got {v}")
        return v

    @field_validator("compression", "result_compression")
    @classmethod
    def _codec(cls, v, info):
        if v is not None:  # the registry's one-line ValueError for any name it refuses
            get_codec(v, averages=info.field_name == "result_compression")
        return v

    @model_validator(mode="after")
    def _format_needs(self):
        codec = get_codec(self.compression)
        if self.error_feedback is False and codec.needs_error_feedback:
            raise ValueError(f"error_feedback: {self.compression} owes what a round does not send to later rounds; "
                             "it needs error feedback (leave error_feedback unset)")
        if self.error_decay is not None and not codec.allows_error_decay:
            raise ValueError(f"error_decay is for the formats that owe what they leave out in a residual (topkN+), "
                             f"not {self.compression!r}")
        return self

    @property
    def uses_error_feedback(self) -> bool:
        if self.error_feedback is not None:
            return self.error_feedback
        codec = get_codec(self.compression)
        return codec.needs_error_feedback or codec.error_feedback_pays

    @field_validator("initial_peers")
    @classmethod
    def _peers(cls, v):
        for addr in v:
            _check_maddr(addr, "initial peer")
            if "/p2p/" not in addr:
                raise ValueError(f"{addr!r} has no /p2p/<peer id> part; copy the full address a peer printed")
            peer_id = addr.rstrip("/").rsplit("/p2p/", 1)[1].split("/")[0]
            if not _is_peer_id(peer_id):
                raise ValueError(f"{addr!r}: {peer_id!r} is not a peer id (like 12D3KooW... or Qm...); "
                                 "copy the full address a peer printed")
        return v

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _maddrs(cls, v):
        for addr in v:
            _check_maddr(addr, "listen/announce address")
        return v

    @model_validator(mode="after")
    def _enable(self):
        if self.initial_peers:
            self.enabled = True
        return self


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    swarm: SwarmConfig = SwarmConfig()

    @property
    def worker(self) -> str:
        return self.run.worker or socket.gethostname()

    @property
    def run_dir(self) -> Path:
        if self.run.dir:
            return Path(self.run.dir)
        return Path("runs") / (self.run.name or self.swarm.run_id) / self.worker

    @property
    def shard_key(self) -> str:
        return self.data.shard_seed if self.data.shard_seed is not None else self.worker


FINGERPRINT_KEYS = {
    "model": None,  # every field: the same shapes can hide other heads, init or norms
    "data": ("tokenizer",),
    "optim": ("local_steps", "fragments", "outer_lr", "outer_momentum", "outer_nesterov"),
    "swarm": ("weight_by_samples",),
}
"""The settings every worker of a run must share: they decide θ_global's shapes and meaning, the
round keys, and how contributions are weighted. Everything else may differ between workers."""


def fingerprint_covers() -> str:
    """The ``FINGERPRINT_KEYS`` in words, for messages: "the [model] section, data.tokenizer, ... and
    swarm.weight_by_samples"."""
    named = [f"the [{section}] section" if keys is None else f"{section}.{key}"
             for section, keys in FINGERPRINT_KEYS.items() for key in (keys or (None,))]
    return ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0]


def config_fingerprint(cfg: Config) -> str:
    """A short hash of the ``FINGERPRINT_KEYS`` settings: workers whose fingerprints differ never average."""
    dumped = cfg.model_dump()
    picked = {section: {k: v for k, v in dumped[section].items() if keys is None or k in keys}
              for section, keys in FINGERPRINT_KEYS.items()}
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


# -- loading ----------------------------------------------------------------------------------

def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """``['--optim.local-steps', '50', '--swarm.initial-peers', 'A', 'B']`` -> nested dict.

    Values are parsed by the type of the field they set; list fields take every value up to
    the next ``--option``; a bool field given without a value means true; ``none`` sets an
    optional field to None.
    """
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key VALUE")
        key, _, inline = arg[2:].partition("=")
        values = [inline] if inline else []
        i += 1
        if not inline:
            while i < len(args) and not (args[i].startswith("--") and len(args[i]) > 2):
                values.append(args[i])
                i += 1
        section, _, name = key.replace("-", "_").partition(".")
        dotted = f"{section}.{name}"
        if section not in Config.model_fields or not name:
            raise ConfigError(f"{key}: unknown key")
        model = Config.model_fields[section].annotation
        table, _, entry = name.partition(".")
        if entry and table in model.model_fields and model.model_fields[table].annotation == dict[str, Any]:
            # --model.options.n-layer 4: one entry of a table, its value read as TOML reads it
            out.setdefault(section, {}).setdefault(table, {})[entry] = _toml_scalar(values, dotted)
            continue
        if name not in model.model_fields:
            raise ConfigError(f"{dotted}: unknown key")
        out.setdefault(section, {})[name] = _parse_value(model.model_fields[name].annotation, values, dotted)
    return out


def _parse_value(annotation, values: list[str], dotted: str):
    adapter = TypeAdapter(annotation)
    origin = getattr(annotation, "__origin__", None)
    if origin in (list, tuple):
        raw: Any = values
    elif not values:
        if annotation is not bool:
            raise ConfigError(f"{dotted}: needs a value")
        raw = True
    elif len(values) > 1:
        raise ConfigError(f"{dotted}: expected one value, got {len(values)}")
    elif values[0].lower() in ("none", "null") and _nullable(annotation):
        raw = None
    else:
        raw = values[0]
    try:
        return adapter.validate_python(raw)
    except ValidationError as e:
        raise ConfigError(f"{dotted}: {describe(e.errors()[0])}") from None


def _toml_scalar(values: list[str], dotted: str):
    """One value of a table given on the command line: a TOML value (``4``, ``1e-5``, ``true``,
    ``[1, 2]``), else the text itself."""
    if len(values) != 1:
        raise ConfigError(f"{dotted}: expected one value, got {len(values)}")
    try:
        return tomllib.loads(f"v = {values[0]}")["v"]
    except tomllib.TOMLDecodeError:
        return values[0]


def _nullable(annotation) -> bool:
    return type(None) in getattr(annotation, "__args__", ())


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Reads a TOML file, applies command-line overrides, and validates the result strictly."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    data = _merge(data, parse_overrides(overrides or []))
    return validate_config(data)


def validate_config(data: dict) -> Config:
    try:
        # Strict: a TOML string where a number belongs is an error, not silently converted.
        return Config.model_validate(data, strict=True)
    except ValidationError as e:
        raise ConfigError(in_one_line(e, Config.model_fields)) from None


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (for ``--print-config`` and the run dir)."""
    lines = []
    for section, values in cfg.model_dump().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if section == "model" and values["arch"] == "hf" and k in _LLAMA_KEYS:
                continue  # the built-in llama's settings: unused
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)
