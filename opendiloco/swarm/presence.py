"""Presence: this worker's progress record (with a heartbeat), the run's live workers, drift checks."""

from __future__ import annotations

import asyncio
import logging
import threading

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from ..errors import BehindError, DriftError
from . import records

log = logging.getLogger(__name__)


class Presence:
    """Publishes ``WorkerRecord``s under the run's workers key; reads everyone else's.

    ``report`` may be called from any thread; publishing happens on the communicator's event
    loop. A record expires ``record_ttl`` seconds after its last heartbeat, so a frozen or dead
    worker drops out of the live set by itself.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, peer_id: str, loop: asyncio.AbstractEventLoop, *,
                 heartbeat_interval: float, record_ttl: float, config: str = ""):
        self.dht, self.run_id, self.peer_id, self.loop = dht, run_id, peer_id, loop
        self.heartbeat_interval, self.record_ttl = heartbeat_interval, record_ttl
        self.config = config
        """This worker's config fingerprint: workers with another one are not part of its run."""
        self._foreign: set[str] = set()
        self._progress: dict = {"outer_step": -1, "config": config}
        self._lock = threading.Lock()
        self._publishing: set = set()
        self._heartbeat = asyncio.run_coroutine_threadsafe(self._beat(), loop)

    def get(self, name: str, default=None):
        with self._lock:
            return self._progress.get(name, default)

    def report(self, **fields) -> None:
        """Updates this worker's record; published at once if its outer step or readiness changed,
        else with the next heartbeat. ``ready_in`` (seconds from now) is stored as ``ready_at``."""
        now = get_dht_time()
        if "ready_in" in fields:  # None: not known yet
            ready_in = fields.pop("ready_in")
            fields["ready_at"] = None if ready_in is None else now + min(float(ready_in), 1e7)
        if "round_work" in fields:
            fields["pace_time"] = now
        with self._lock:
            changed = any(k in fields and fields[k] != self._progress.get(k, default)
                          for k, default in (("outer_step", -1), ("ready", False), ("next_round", -1)))
            self._progress.update(fields)
        if changed:  # keep the future: an unreferenced task may be garbage-collected mid-flight
            future = asyncio.run_coroutine_threadsafe(self.publish(), self.loop)
            self._publishing.add(future)
            future.add_done_callback(self._publishing.discard)

    async def publish(self, left: bool = False) -> None:
        with self._lock:
            rec = records.WorkerRecord(peer_id=self.peer_id, time=get_dht_time(), left=left,
                                       **{k: v for k, v in self._progress.items()
                                          if k in records.WorkerRecord.__dataclass_fields__})
        await self.dht.store(records.workers_key(self.run_id), rec.to_value(), get_dht_time() + self.record_ttl,
                             subkey=self.peer_id, return_future=True)

    async def _beat(self) -> None:
        while True:
            try:
                await self.publish()
            except Exception as e:  # the DHT may be shutting down
                log.debug("heartbeat failed: %s", e)
            await asyncio.sleep(self.heartbeat_interval)

    def live_workers(self) -> dict[str, records.WorkerRecord]:
        """The run's live workers with this worker's settings (others are left out, with a warning)."""
        return self.same_settings(records.read_workers(self.dht, self.run_id))

    def same_settings(self, workers: dict[str, records.WorkerRecord]) -> dict[str, records.WorkerRecord]:
        out = {}
        for peer, rec in workers.items():
            if peer == self.peer_id or rec.config == self.config:
                out[peer] = rec
            elif peer not in self._foreign:
                self._foreign.add(peer)
                log.warning("worker %s of run %r has other settings (config fingerprint %s, ours %s): it is "
                            "never waited for, averaged with or downloaded from", peer[-8:], self.run_id,
                            rec.config or "none", self.config or "none")
        return out

    def other_settings(self) -> list[records.WorkerRecord]:
        """Live workers of the run whose config fingerprint differs from this worker's."""
        return [r for p, r in records.read_workers(self.dht, self.run_id).items()
                if p != self.peer_id and r.config != self.config]

    def raise_if_behind(self, workers: dict[str, records.WorkerRecord], outer_step: int) -> None:
        ahead = [r.outer_step for p, r in workers.items() if p != self.peer_id and r.outer_step > outer_step]
        if ahead:
            raise BehindError(f"peers are at outer step {max(ahead)}, this worker at {outer_step}",
                              group_outer_step=max(ahead))

    def raise_if_drifted(self, outer_step: int, workers: dict[str, records.WorkerRecord]) -> None:
        """Compares our θ_global hash with the other workers at the same outer step (majority wins)."""
        mine = self.get("global_hash")
        if not mine:
            return
        counts: dict[str, int] = {mine: 1}
        for peer, rec in workers.items():
            if peer != self.peer_id and rec.outer_step == outer_step and rec.global_hash:
                counts[rec.global_hash] = counts.get(rec.global_hash, 0) + 1
        majority, votes = max(counts.items(), key=lambda kv: kv[1])
        if majority != mine and votes > counts[mine]:
            raise DriftError(f"θ_global drifted: hash {mine} vs {majority} held by {votes} peer(s) at outer step "
                             f"{outer_step}", group_outer_step=outer_step, majority_hash=majority)

    async def leave(self) -> None:
        """Stops the heartbeat and tells the run this worker left (others stop waiting for it at once)."""
        self._heartbeat.cancel()
        await self.publish(left=True)
