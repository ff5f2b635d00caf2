"""The run's live workers as last read, refreshed in the background: what is asked after every inner
step (``SwarmCommunicator.peer_paces``) and by a round's watches, never waiting on the network."""

from __future__ import annotations

import asyncio
import logging

from .presence import Presence
from .records import RunRecords, WorkerRecord

log = logging.getLogger(__name__)


class RunSnapshot:
    """The run's workers with this worker's settings (``Presence.same_settings``), as last read."""

    def __init__(self, dht, records: RunRecords, presence: Presence, heartbeat_interval: float):
        self.dht, self.records, self.presence = dht, records, presence
        self.interval = min(1.0, max(0.25, heartbeat_interval / 4))
        """Read four times a heartbeat (0.5 s by default): a record changes at its writer's heartbeat, or at
        once when its outer step or readiness does, and the pace estimate extrapolates each peer's work
        from when its figure was true. Each read is a DHT lookup the peers answer, with every record's
        signature checked: at eight reads a heartbeat the reads were most of an idle run's CPU."""
        self.workers: dict[str, WorkerRecord] = {}
        self.reads = 0
        """Successful reads of the run's workers so far."""

    async def refresh(self) -> None:
        """Reads the run's workers every ``interval`` seconds, for ever (on the communicator's loop)."""
        key = self.records.workers_key()
        while True:
            try:
                found = await self.dht.get(key, latest=True, return_future=True)
                workers = self.records.workers_from(found, self.presence.max_ttl)
                self.workers = self.presence.same_settings(workers)
                self.reads += 1
            except Exception as e:  # the DHT may be busy or shutting down: keep the last snapshot
                log.debug("refreshing the workers snapshot: %s", e)
            await asyncio.sleep(self.interval)
