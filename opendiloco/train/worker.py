"""Joining a swarm as a worker: the rules ``opendiloco train`` and ``opendiloco.connect`` share.

A worker's run is closed by its secret, or open by explicit choice, with a warning
(``check_membership``). It keeps one peer identity in a directory of its own, is refused at start
when the run's workers train with other settings, and checks at start that peers can dial it back
(``join_swarm``). The CLI's trainer takes the settings from its ``[swarm]`` section and its
fingerprint from its config; ``connect`` takes the same keys as arguments and the fingerprint from
the settings and the model its caller names.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from opendiloco.errors import SwarmError

from .config import ConfigError, SwarmConfig
from .validation_errors import in_one_line

if TYPE_CHECKING:
    import torch

    from opendiloco.swarm.communicator import SwarmCommunicator

log = logging.getLogger(__name__)

OPEN_RUN_ALLOWS = ("anyone who can reach one of its workers can join it, vote on the run's state, serve state "
                   "to workers that join or catch up, download the model, read the run's records and stall its "
                   "rounds")
"""What an open run allows, said when a worker refuses to start without a secret and when one starts open."""

NOT_COMMUNICATOR_KEYS = {
    "enabled": "connect() always joins a swarm",
    "join_timeout": "a joiner catches up at its first round (DiLoCoOptimizer(catch_up_timeout=...))",
    "on_join_failure": "a joiner catches up at its first round (DiLoCoOptimizer(catch_up_timeout=...))",
    "weight_by_samples": "pass it to DiLoCoOptimizer(weight_by_samples=...)",
    "error_feedback": "pass it to DiLoCoOptimizer(error_feedback=...)",
    "error_decay": "pass it to DiLoCoOptimizer(error_decay=...)",
}
"""``[swarm]`` keys that are the trainer's or the optimizer's, not the communicator's: ``connect`` names
where each one goes instead of ignoring it."""


def check_membership(swarm: SwarmConfig, *, warn: bool = True) -> bool:
    """A swarm worker's run is closed (a run secret) or open by explicit choice (``[swarm] open``):
    returns whether it is closed, or raises ``SwarmError`` (one line) when neither or both are given.
    A worker that trains alone (``enabled`` false) needs neither."""
    if not swarm.enabled:
        return False
    from opendiloco.swarm.membership import SECRET_FILE_ENV, RunSecret

    secret = RunSecret.from_environment(swarm.secret_file)  # a missing or short secret: SwarmError now
    if secret is not None and swarm.open:
        raise SwarmError(f"[swarm] open (--swarm.open) asks for an open run, but a run secret is given "
                         f"({secret.source}): a run is either closed by its secret or open; drop one of the two")
    if secret is None and not swarm.open:
        raise SwarmError(f"this worker would join a swarm without a run secret. Make one with `opendiloco secret "
                         f"FILE` and start every worker of the run with {SECRET_FILE_ENV}=FILE (or [swarm] "
                         f"secret_file = FILE); or choose an open run, in which {OPEN_RUN_ALLOWS}, with "
                         "--swarm.open ([swarm] open = true, connect(open=True); docs/trust.md)")
    if secret is None and warn:
        log.warning("run %r is OPEN ([swarm] open, no run secret): %s. To close it, start every worker with "
                    "the same secret: `opendiloco secret FILE`, then %s=FILE (docs/trust.md)",
                    swarm.run_id, OPEN_RUN_ALLOWS, SECRET_FILE_ENV)
    return secret is not None


def join_swarm(swarm: SwarmConfig, *, identity_dir: str | Path | None, fingerprint: str,
               covers: str, advice: str = "") -> SwarmCommunicator:
    """Starts this worker's DHT node and communicator with ``swarm``'s settings (after
    ``check_membership``): its peer identity kept in ``identity_dir`` (``peer.key``, unless
    ``identity_path`` names one), refused (``OtherSettings``, one line naming ``covers``) when the
    run's live workers all have another ``fingerprint``, and a warning if the first initial peer
    cannot dial it back."""
    from opendiloco.swarm.communicator import SwarmCommunicator
    from opendiloco.swarm.presence import OtherSettings

    try:  # the swarm's settings: every one named in SwarmSettings.from_config
        return SwarmCommunicator.from_config(swarm, run_dir=identity_dir, config_fingerprint=fingerprint)
    except OtherSettings as e:  # the swarm names the fingerprint; what it covers is the caller's to name
        raise e.covering(covers, advice) from None


def loop_fingerprint(settings: Mapping[str, Any] | None, model: torch.nn.Module | None) -> str:
    """A short hash of what ``connect``'s caller says every worker must share: its ``settings`` (JSON
    values) and the names, shapes and dtypes of ``model``'s state (parameters and persistent buffers)."""
    layout = None if model is None else [[name, list(t.shape), str(t.dtype)] for name, t in model.state_dict().items()]
    try:
        text = json.dumps({"settings": dict(settings or {}), "model": layout}, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"connect: settings must be JSON values (numbers, strings, lists, tables): {e}") from None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def connect(initial_peers: Sequence[str] | str | None = None, *, identity_dir: str | Path, open: bool = False,
            settings: Mapping[str, Any] | None = None, model: torch.nn.Module | None = None,
            **swarm: Any) -> SwarmCommunicator:
    """Joins a swarm as a worker with everything ``opendiloco train`` gives one, and returns the
    communicator to hand ``DiLoCoOptimizer(communicator=...)`` (close it, or use it in ``with``).

    - ``initial_peers``: addresses a peer printed (``/ip4/IP/tcp/PORT/p2p/PEER_ID``); none for the
      first worker of a run.
    - Closed: the run secret comes from ``secret_file=`` or the environment (``OPENDILOCO_RUN_SECRET_FILE``,
      ``OPENDILOCO_RUN_SECRET``), as for the CLI. Without one it refuses, unless ``open=True``, which
      makes an open run and says so in a warning.
    - ``identity_dir``: where this worker keeps its peer identity (``peer.key``) and its addresses
      (``peer_addrs.txt``); restarted with the same directory, it is the same peer to the run.
    - ``settings`` and ``model``: what every worker of the run must share (e.g. ``{"local_steps": 500}``
      and the model, whose parameter names and shapes count): a worker whose run's live workers all
      have other ones is refused at start, in one line.
    - Any other keyword is a ``[swarm]`` key of the trainer's config (``run_id``, ``compression``,
      ``min_group_size``, ``host_maddrs``, ``matchmaking_timeout``...; docs/config.md), checked the same way.

    Raises ``ValueError`` (a bad key or value) or ``opendiloco.errors.SwarmError`` (no secret, a peer
    that cannot be reached, other settings), each with a one-line message.
    """
    elsewhere = sorted(swarm.keys() & NOT_COMMUNICATOR_KEYS.keys())
    if elsewhere:
        raise ConfigError(f"connect: {elsewhere[0]} is not a communicator setting: "
                          f"{NOT_COMMUNICATOR_KEYS[elsewhere[0]]}")
    peers = [initial_peers] if isinstance(initial_peers, str) else list(initial_peers or [])
    try:
        config = SwarmConfig(**swarm, initial_peers=peers, open=bool(open), enabled=True)
    except ValidationError as e:
        raise ConfigError(f"connect: {in_one_line(e)}") from None
    fingerprint = loop_fingerprint(settings, model)
    check_membership(config)
    return join_swarm(config, identity_dir=identity_dir, fingerprint=fingerprint,
                      covers="the settings and the model's parameter shapes given to connect()")
