"""`opendiloco status`: the live workers of a run, read from their DHT records (``--serve``: as a page)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence

from hivemind.utils.timed_storage import get_dht_time

from opendiloco.comm.base import RoundKey
from opendiloco.errors import AveragingError

from .. import records
from ..daemon.node import SwarmError, start_dht
from ..membership import Membership, RunSecret
from .status_page import RunHistory, StatusServer, keep_reading


def fetch_workers(initial_peers: Sequence[str], run_id: str, secret: RunSecret | None = None,
                  settle: float = 1.0) -> list[records.WorkerRecord]:
    """The run's live workers; a closed run's records can be read only with its ``secret``."""
    dht = start_dht(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                    use_relay=False)  # a reader takes no relay slot: a relay holds each for an hour
    try:
        time.sleep(settle)  # let the routing table fill before asking
        workers = records.RunRecords(dht, Membership(run_id, secret)).read_workers()
    except AveragingError as e:  # the DHT did not answer in time
        raise SwarmError(str(e)) from None
    finally:
        dht.shutdown()
    return sorted(workers.values(), key=lambda r: (-r.outer_step, r.peer_id))


def format_table(workers: Sequence[records.WorkerRecord], run_id: str) -> str:
    if not workers:
        return f"run {run_id!r}: no live workers"
    now = get_dht_time()
    rows = [("peer", "outer", "inner", "steps/s", "samples/s", "round", "contributed", "dropped", "loss",
             "since sync", "global_hash")]
    for w in workers:
        since = f"{now - w.last_sync_time:.0f}s" if w.last_sync_time else "-"
        loss = f"{w.loss:.4f}" if isinstance(w.loss, (int, float)) else "-"
        taken = w.contributed_steps + w.dropped_steps
        share = f" ({w.contributed_steps / taken:.0%})" if taken else ""
        state = "waiting" if w.ready else f"{w.round_work:g}"
        rows.append((w.peer_id, str(w.outer_step), str(w.inner_step), f"{w.steps_per_s:.2f}", f"{w.samples_per_s:.1f}",
                     state, f"{w.contributed_steps}{share}", str(w.dropped_steps), loss, since, w.global_hash or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    hashes = {w.global_hash for w in workers if w.global_hash}
    lines.append(f"run {run_id!r}: {len(workers)} live worker(s); "
                 + ("global_hash agrees" if len(hashes) <= 1 else f"{len(hashes)} different global_hash values"))
    return "\n".join(lines)


async def _connected_peers(dht, node) -> dict[str, list[str]]:
    """Runs in the DHT process: the peers its p2p daemon is connected to, with their addresses."""
    return {str(p.peer_id): [str(a) for a in p.addrs] for p in await node.p2p.list_peers()}


class RunReader:
    """The records of one run, read again and again through one DHT client (``status --serve``).

    It reads what ``opendiloco status`` reads, plus the announcements and groups of each worker's last
    round (group size and time); a closed run's records only with its ``secret``.
    """

    def __init__(self, initial_peers: Sequence[str], run_id: str, secret: RunSecret | None = None,
                 settle: float = 1.0):
        self.dht = start_dht(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                             use_relay=False)  # a reader takes no relay slot: a relay holds each for an hour
        self.records = records.RunRecords(self.dht, Membership(run_id, secret))
        self._rounds: dict[int, dict[str, dict]] = {}
        time.sleep(settle)  # let the routing table fill before asking

    def workers(self) -> list[records.WorkerRecord]:
        try:
            found = self.records.read_workers()
        except AveragingError as e:  # the DHT did not answer in time
            raise SwarmError(str(e)) from None
        return sorted(found.values(), key=lambda r: (-r.outer_step, r.peer_id))

    def last_rounds(self, workers: Sequence[records.WorkerRecord]) -> dict[str, dict]:
        """Per worker, the round that brought it to its outer step: ``{"group_size", "seconds"}`` as its
        records in the DHT tell (from its announcement to its last sync); workers whose round records
        have expired (or a streamed round's fragments) are left out."""
        out = {}
        for step in {w.outer_step for w in workers if w.outer_step > 0}:
            known = self._rounds.get(step)
            if known is None or any(w.peer_id not in known for w in workers if w.outer_step == step):
                known = self._rounds[step] = self._round(step)
            for w in workers:
                if w.outer_step == step and w.peer_id in known:
                    info = dict(known[w.peer_id])
                    since = info.pop("since", None)
                    if isinstance(since, (int, float)) and w.last_sync_time >= since:
                        info["seconds"] = w.last_sync_time - since
                    out[w.peer_id] = info
        for step in sorted(self._rounds)[:-8]:
            del self._rounds[step]
        return out

    def _round(self, outer_step: int) -> dict[str, dict]:
        """Members of the groups that averaged round ``outer_step - 1``, each with its announcement's start."""
        key = RoundKey(outer_step - 1)
        ttl = 3600.0
        try:
            announced = {p: v for p, v in self.records.subkey_values(self.records.round_key(key), ttl).items()
                         if isinstance(v, dict) and type(v.get("attempt")) is int}
            found = {}
            for attempt in sorted({v["attempt"] for v in announced.values()})[-4:]:
                groups = self.records.subkey_values(self.records.group_key(key, attempt), ttl)
                for publisher, members in groups.items():
                    if not (isinstance(members, list) and members and publisher == min(map(str, members))):
                        continue
                    for m in members:
                        if m in announced and announced[m].get("attempt") == attempt:
                            found[m] = {"group_size": len(members), "since": announced[m].get("since")}
            return found
        except AveragingError:
            return {}

    def addresses(self) -> dict[str, list[str]]:
        """Addresses of the peers this reader's DHT node is connected to (workers it has read from)."""
        try:
            return self.dht.run_coroutine(_connected_peers)
        except Exception:  # the DHT process is busy or gone: no addresses this time
            return {}

    def close(self) -> None:
        self.dht.shutdown()


def serve_status(initial_peers: Sequence[str], run_id: str, secret: RunSecret | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, interval: float = 2.0,
                 stop: threading.Event | None = None) -> int:
    """Serves the run's page (``status_page.py``) until SIGINT/SIGTERM (or ``stop``), reading the run
    every ``interval`` seconds. ``OSError`` if the address cannot be bound, ``SwarmError`` if the DHT
    cannot be joined."""
    history = RunHistory(run_id, closed=secret is not None)
    server = StatusServer(history, host, port).start()
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"the status page of run {run_id!r}: {server.url}", flush=True)
        reader = RunReader(initial_peers, run_id, secret)
        try:
            def read():
                workers = reader.workers()
                return workers, reader.last_rounds(workers), reader.addresses()

            keep_reading(history, read, stop, interval)
        finally:
            reader.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
    return 0
