"""``SwarmSettings``: how a worker takes part in its run's rounds, taken from the trainer's ``[swarm]``
config section, and the checks a communicator makes on them before it starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import ClassVar

from ..comm.aggregation import Aggregation
from ..comm.audit import DEFAULT_AUDIT_CHUNKS
from ..comm.group import DEFAULT_PART_NUMEL
from .exclusion import EXCLUDE_ROUNDS
from .match_rule import MatchmakingSettings


@dataclass
class SwarmSettings:
    """How a worker takes part in its run's rounds. The trainer sets every field from its ``[swarm]``
    config section, under the same name (``from_config``), except those in ``NOT_FROM_CONFIG``."""

    run_id: str = "opendiloco"
    """Workers with the same run id (and the same secret and config fingerprint) train together."""
    compression: str = "fp16"
    """The contributions' codec (``opendiloco.comm.compression``); part of what a group agrees on."""
    result_compression: str | None = None
    """The averaged shards' codec; None: the same as the contributions'."""
    min_group_size: int = 1
    """The fewest workers a round may have."""
    matchmaking_timeout: float = 30.0
    """Seconds a round waits for ``min_group_size`` workers (longer while a live peer says it is coming)."""
    allreduce_timeout: float = 60.0
    """Seconds an attempt's exchange may take once its group is formed."""
    straggler_wait: float = 10.0
    """Grace, in seconds, beyond the time a slower peer published it would be ready."""
    max_attempts: int = 3
    """Attempts of one round (each with whoever is still there) before it fails."""
    heartbeat_interval: float = 2.0
    """Seconds between two publications of this worker's record. Not from the config: it must stay
    well under ``record_ttl``, and a run's secret records live for ten heartbeats of their writer,
    bounded by each reader's own (library callers may set both together, the same on every worker)."""
    record_ttl: float = 8.0
    """Seconds a worker's record lives after its last heartbeat. Not from the config: every reader
    drops a record set to live longer than its own ``record_ttl`` (plus a clock slack) as a forgery,
    so a worker with a longer one would vanish from its peers' view; the same on every worker."""
    verify_timeout: float = 5.0
    """Seconds a member waits for the others' confirmations of the average's digest."""
    poll_interval: float = 0.02
    """Seconds between two looks at the DHT while a group forms (a doorbell ring wakes it sooner)."""
    quiet_poll_interval: float = 0.25
    """The longest gap between two looks while no announcement changes (doubled from ``poll_interval``)."""
    max_wait: float = 600.0
    """The longest a round waits for a live peer that says it is coming (its published ready time)."""
    part_numel: int = DEFAULT_PART_NUMEL
    """Values per streamed part of a contribution (a multiple of 1024, every codec's block); part of what
    a group agrees on."""
    aggregation: Aggregation = dataclass_field(default_factory=Aggregation)
    """How shard owners combine contributions: weight and norm bounds, optionally CenteredClip
    (``opendiloco.comm.aggregation``); part of what a group agrees on."""
    audit_chunks: int = DEFAULT_AUDIT_CHUNKS
    """Random chunks of every other owner's shard result a member recomputes per round
    (``opendiloco.comm.audit``; 0: none); part of what a group agrees on."""
    exclude_rounds: int = EXCLUDE_ROUNDS
    """How many outer steps a member caught sending malformed data is left out of this worker's groups
    (``exclusion.py``)."""
    partition_hold: float = 120.0
    """The longest, in seconds, a worker whose groups lack most of the workers it last averaged with (a
    partition, or a crash of most of them) holds its work instead of applying rounds apart from them
    (``majority.py``); 0: never holds (both sides of a partition go on, and the smaller heals)."""
    cut_off_after: float = 15.0
    """Seconds a member of an attempt may hear nothing from any other member, while it still waits on
    them, before it takes itself for cut off (its address changed, its links broke: its streams hang on
    connections that are gone while its record stays fresh). It abandons the attempt, drops its
    connections to the members and says so in its record, so they give up on it at once; 0: never."""
    config_fingerprint: str = ""
    """The hash of the settings every worker of the run must share: a worker with another one is
    refused at start when every live worker of the run has them (``startup.refuse_other_settings``), and
    never grouped with, waited for or downloaded from. Not a config key: the trainer computes it
    from the config."""

    NOT_FROM_CONFIG: ClassVar[frozenset[str]] = frozenset({"heartbeat_interval", "record_ttl",
                                                           "config_fingerprint"})
    """The fields the trainer's config does not set (each says why); every other field is a ``[swarm]``
    key of the same name (``aggregation`` with ``clip_ratio`` and ``max_weight_ratio``)."""

    @classmethod
    def from_config(cls, cfg, config_fingerprint: str = "") -> SwarmSettings:
        """The settings of a ``[swarm]`` config section (``opendiloco.train.config.SwarmConfig``; taken
        as it comes, since this layer never imports the trainer), each field from the key of its name: a field
        added here needs a key there, or a place in ``NOT_FROM_CONFIG`` (tests/test_swarm_settings.py checks it)."""
        keys = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)
                if f.name not in cls.NOT_FROM_CONFIG and f.name != "aggregation"}
        aggregation = Aggregation(cfg.aggregation, clip_ratio=cfg.clip_ratio, max_weight_ratio=cfg.max_weight_ratio)
        return cls(**keys, aggregation=aggregation, config_fingerprint=config_fingerprint)

    def check(self) -> None:
        """Raises ``ValueError`` (one line) for a setting no round can run with."""
        if self.min_group_size < 1:
            raise ValueError("min_group_size must be >= 1")
        if not isinstance(self.part_numel, int) or self.part_numel < 1024 or self.part_numel % 1024:
            raise ValueError("part_numel must be a positive multiple of 1024 (every codec's block)")

    def matchmaking_settings(self) -> MatchmakingSettings:
        """What the matchmaker is given of these settings. Its announcements and groups live as long as a
        round may wait and exchange (``max_wait + matchmaking_timeout + allreduce_timeout``)."""
        return MatchmakingSettings(
            run_id=self.run_id, min_group_size=self.min_group_size, matchmaking_timeout=self.matchmaking_timeout,
            straggler_wait=self.straggler_wait, max_wait=self.max_wait,
            record_ttl=self.max_wait + self.matchmaking_timeout + self.allreduce_timeout,
            poll_interval=self.poll_interval, quiet_poll_interval=self.quiet_poll_interval, part_numel=self.part_numel,
            config=self.config_fingerprint)
