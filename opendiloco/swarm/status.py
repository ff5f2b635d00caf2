"""`opendiloco status`: the live workers of a run, read from their DHT records."""

from __future__ import annotations

import time
from collections.abc import Sequence

from hivemind.utils.timed_storage import get_dht_time

from opendiloco.errors import AveragingError

from . import records
from .membership import Membership, RunSecret
from .node import SwarmError, start_dht


def fetch_workers(initial_peers: Sequence[str], run_id: str, secret: RunSecret | None = None,
                  settle: float = 1.0) -> list[records.WorkerRecord]:
    """The run's live workers; a closed run's records can be read only with its ``secret``."""
    dht = start_dht(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
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
