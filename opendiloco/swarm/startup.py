"""A worker's start in its run from its ``[swarm]`` config section: its DHT node (with its own identity
in its run dir, so that a restarted worker is the same peer), its communicator, the refusal of a run whose
live workers all train with other settings, what it tells the operator (where peers join it, whether
the run is open), the files it leaves in its run dir, and a short reachability check off its path."""

from __future__ import annotations

import logging
import os
import threading

from ..errors import AveragingError
from .daemon.node import start_dht, visible_maddrs, worker_identity
from .membership import SECRET_FILE_ENV, RunSecret
from .ops.doctor import startup_warnings
from .partners import PARTNERS_FILE
from .presence import OtherSettings, Presence
from .settings import SwarmSettings

log = logging.getLogger(__name__)

PEER_ADDRS_FILE = "peer_addrs.txt"
"""In the run dir: the addresses through which peers join this worker, one a line."""


def start_from_config(make, cfg, run_dir: str | None = None, config_fingerprint: str = ""):
    """``make(dht, settings, secret=)`` (the communicator's class) on a DHT node started from a
    ``SwarmConfig``, with ``SwarmSettings.from_config``; refuses a run whose live workers have other
    settings (``OtherSettings``). The run secret comes from the environment or ``cfg.secret_file``
    (``RunSecret.from_environment``)."""
    secret = RunSecret.from_environment(cfg.secret_file)
    # Its own identity in its run dir, unless one is given: restarted there, it is the same peer.
    own = cfg.identity_path is None and run_dir is not None
    dht = start_dht(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs,
                    announce_maddrs=cfg.announce_maddrs,
                    identity_path=worker_identity(str(run_dir)) if own else cfg.identity_path,
                    identity_locked=own, client_mode=cfg.client_mode)
    settings = SwarmSettings.from_config(cfg, config_fingerprint)
    comm = make(dht, settings, secret=secret)
    try:
        refuse_other_settings(comm.presence, comm.peer_id, settings)
    except BaseException:
        comm.close()
        raise
    addrs = visible_maddrs(dht)
    log.info("worker %s joined run %r; peers can join through: %s", comm.peer_id, settings.run_id,
             " ".join(addrs))
    if secret is None:
        log.warning("run %r is open (no run secret): anyone who can reach a worker can read the run's records, "
                    "download its state and join it; to close it, start every worker with the same secret in "
                    "$%s or the secret_file setting (docs/trust.md)", settings.run_id, SECRET_FILE_ENV)
    else:
        log.info("run %r is closed: only workers started with its secret (%s) take part", settings.run_id,
                 secret.source)
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        comm.presence.partners.keep_in(os.path.join(run_dir, PARTNERS_FILE))  # known again after a restart
        with open(os.path.join(run_dir, PEER_ADDRS_FILE), "w") as f:
            f.write("\n".join(addrs) + "\n")
    threading.Thread(target=warn_if_unreachable, args=(dht, list(cfg.initial_peers), cfg.client_mode),
                     name="opendiloco-reach-check", daemon=True).start()
    return comm


def refuse_other_settings(presence: Presence, peer_id: str, settings: SwarmSettings) -> None:
    """Raises ``OtherSettings`` (one line) if the run's live workers all train with another config
    fingerprint: this worker is the odd one out. Workers with other settings beside some with
    this worker's are their writers' problem (never grouped with, waited for or downloaded
    from, and named in a warning): one record cannot keep every newcomer out of a run."""
    try:
        workers = presence.records.read_workers(presence.max_ttl)
    except AveragingError as e:  # the DHT did not answer: the rounds' own checks still apply
        log.warning("could not compare settings with the run's workers: %s", e)
        return
    others = [r for p, r in workers.items() if p != peer_id]
    foreign = [r for r in others if r.config != settings.config_fingerprint]
    if not foreign:
        return
    if len(foreign) < len(others):
        presence.same_settings(workers)  # warns once for each of the others
        return
    rec, mine = foreign[0], settings.config_fingerprint or "none"
    raise OtherSettings(f"worker {rec.peer_id[-8:]} of run {settings.run_id!r} trains with other settings "
                        f"(config fingerprint {rec.config or 'none'}, this worker's {mine})")


def warn_if_unreachable(dht, initial_peers: list[str], client_mode: bool) -> None:
    """A worker's short reachability check at start (``doctor.startup_warnings``), off its start's path."""
    try:
        for finding in startup_warnings(dht, initial_peers, client_mode):
            log.warning("%s (check this machine with `opendiloco doctor`)", finding.text)
    except Exception as e:  # a check that could not run changes nothing
        log.debug("reachability check at start: %s: %s", type(e).__name__, e)
