"""What workers publish in the DHT, under keys namespaced by ``run_id``.

- ``{run}.workers``: one subkey per live worker, its progress (refreshed by a heartbeat, so a
  frozen or dead worker's record expires);
- ``{run}.round.{k}``: workers ready to average outer step ``k``;
- ``{run}.group.{k}.{attempt}``: the group the round's leader closed.

(``k`` is a round key: the outer step, and the fragment where the model is streamed in parts.)
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import asdict, dataclass, fields

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from opendiloco.errors import AveragingError

log = logging.getLogger(__name__)


def workers_key(run_id: str) -> str:
    return f"{run_id}.workers"


def round_key(run_id: str, key) -> str:
    return f"{run_id}.round.{key}"


def group_key(run_id: str, key, attempt: int) -> str:
    return f"{run_id}.group.{key}.{attempt}"


@dataclass
class WorkerRecord:
    peer_id: str
    outer_step: int = -1
    inner_step: int = 0
    samples_per_s: float = 0.0
    loss: float | None = None
    global_hash: str = ""
    last_sync_time: float = 0.0
    next_sync_eta: float | None = None
    """Seconds until this worker expects to be ready for its next outer step."""
    time: float = 0.0
    left: bool = False
    """Set when a worker leaves cleanly, so others stop waiting for it at once."""

    def to_value(self) -> dict:
        d = asdict(self)
        d.pop("peer_id")
        return d

    @classmethod
    def from_value(cls, peer_id: str, value) -> WorkerRecord | None:
        """Parses a DHT value, or None if it is malformed (a record is input from the network)."""
        if not isinstance(value, dict):
            return None
        known = {f.name for f in fields(cls)} - {"peer_id"}
        try:
            rec = cls(peer_id=str(peer_id), **{k: v for k, v in value.items() if k in known})
            rec.outer_step, rec.inner_step = int(rec.outer_step), int(rec.inner_step)
            return rec
        except (TypeError, ValueError):
            return None


DHT_CALL_TIMEOUT = 30.0


def wait_dht(future, what: str, timeout: float = DHT_CALL_TIMEOUT):
    """The result of a DHT call, or ``AveragingError`` after ``timeout``: a call whose DHT process died
    (or lost the request) would otherwise block the worker for ever."""
    try:
        return future.result(timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):  # distinct types before Python 3.11
        future.cancel()
        raise AveragingError(f"the DHT did not answer a {what} within {timeout:.0f}s") from None


def store(dht: hivemind.DHT, key: str, value, expiration_time: float, subkey: str) -> None:
    """Stores ``value`` under ``key``/``subkey`` until ``expiration_time`` (DHT time), bounded by ``wait_dht``."""
    wait_dht(dht.store(key, value, expiration_time, subkey=subkey, return_future=True), "store")


def subkey_values(dht: hivemind.DHT, key: str) -> dict[str, object]:
    """All live subkey -> value pairs stored under ``key`` (empty if none)."""
    found = wait_dht(dht.get(key, latest=True, return_future=True), "get")
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    return {str(sk): item.value for sk, item in found.value.items() if item.expiration_time > now}


def read_workers(dht: hivemind.DHT, run_id: str) -> dict[str, WorkerRecord]:
    """Live workers of a run (those that left cleanly are dropped)."""
    out = {}
    for peer, value in subkey_values(dht, workers_key(run_id)).items():
        rec = WorkerRecord.from_value(peer, value)
        if rec is None:
            log.debug("ignoring a malformed worker record from %s", peer)
        elif not rec.left:
            out[peer] = rec
    return out
