"""Whose word counts: the peers that have completed a round with this worker.

A fresh identity costs nothing (a key; in a closed run, the secret once), so a vote, a pace or a
ready time from one is cheap to forge many times over. Completing a round with this worker is not
free: the peer sent its part of every shard, reduced its own shard correctly enough to pass every
member's checks, and held the run's θ_global. So once a worker has partners, only their records
(and its own) decide whether it catches up, has drifted or was left behind by the run, only their
paces set its round's target, and only their ready times (or those of peers that just downloaded
its state to join) are believed in full by its matchmaking (any other peer's for one
``straggler_wait`` at most).

A worker's partners are kept in its run dir (``keep_in``), so a worker that restarts there still
knows them. A worker that has partners but sees none of them live (its only partner is restarting,
say) counts its own word alone for ``absent_grace`` seconds (``PARTNERS_GRACE_TTLS`` record
lifetimes): one Sybil record cannot pull it to a state of its own in that gap. After that it trusts
the run's records again, as does a worker that never had a partner (it has just started in a new
run dir, or only ever trained alone): that first contact, and a wait out of the grace while every
partner is away, is where an open run's Sybils, or a closed run's insider with many keys, can still
outvote the honest workers.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_PARTNERS = 4096
"""Remembered at most (the oldest forgotten first): a bound on memory, not on the run's size."""
PARTNERS_FILE = "partners.txt"
"""Where a worker keeps its partners in its run dir (``SwarmCommunicator.from_config``)."""
PEER_ID_CHARS = 128
"""The longest peer id a partners file may hold (base58 ids are 46-53)."""
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


class Partners:
    """The peers that completed a round with this worker (thread-safe, bounded)."""

    def __init__(self, me: str, limit: int = MAX_PARTNERS, absent_grace: float = math.inf,
                 clock: Callable[[], float] = time.monotonic):
        self.me, self.limit, self.absent_grace, self._clock = me, limit, absent_grace, clock
        self._peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._seen_at = clock()
        """When one of its partners was last among the peers asked about (or a round completed with them)."""
        self._path: str | None = None

    def keep_in(self, path: str) -> None:
        """Remembers the partners in ``path`` (one peer id a line), from what it holds now on: read back
        when a worker restarts there. A file that is not such a list is ignored, with a warning."""
        peers = []
        try:
            with open(path, encoding="ascii") as f:
                text = f.read(self.limit * (PEER_ID_CHARS + 1) + 1)
            peers = text.split()
            if len(text) > self.limit * (PEER_ID_CHARS + 1) or not all(
                    len(p) <= PEER_ID_CHARS and set(p) <= _BASE58 for p in peers):
                log.warning("%s is not a list of peer ids: this worker's partners start afresh", path)
                peers = []
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError) as e:
            log.warning("%s cannot be read (%s): this worker's partners start afresh", path, e)
        with self._lock:
            self._path = path
            self._seen_at = self._clock()
        self.add(peers)

    def add(self, members: Iterable[str]) -> None:
        """Members of a round this worker completed (applied) with them."""
        with self._lock:
            before = list(self._peers)
            for peer in members:
                if peer != self.me:
                    self._peers[peer] = None
                    self._peers.move_to_end(peer)
            while len(self._peers) > self.limit:
                self._peers.popitem(last=False)
            self._seen_at = self._clock()
            if self._path is not None and set(self._peers) != set(before):
                self._save(list(self._peers))

    def _save(self, peers: list[str]) -> None:
        try:
            tmp = f"{self._path}.tmp"
            with open(tmp, "w", encoding="ascii") as f:
                f.write("".join(p + "\n" for p in peers))
            os.replace(tmp, self._path)
        except OSError as e:  # a full disk costs the memory of partners across a restart, not the run
            log.warning("this worker's partners could not be kept in %s: %s", self._path, e)

    def __contains__(self, peer: str) -> bool:
        with self._lock:
            return peer in self._peers

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def vouched(self, peers: Iterable[str]) -> set[str]:
        """The peers whose word counts among ``peers`` (``Trust.vouched``)."""
        peers = set(peers)
        return self.trust(peers).vouched(peers)

    def trust(self, peers: Iterable[str]) -> Trust:
        """Whose word counts among ``peers``, as data (for ``Trust.vouched`` of ``peers`` or some of them). Its
        partners among them mark them seen now."""
        with self._lock:
            mine = frozenset(p for p in peers if p in self._peers)
            now = self._clock()
            if mine:
                self._seen_at = now
            return Trust(self.me, mine, bool(self._peers) and now - self._seen_at < self.absent_grace)

    def voters(self, workers: Mapping) -> dict:
        """``workers`` (records by peer id) without the peers whose word does not count."""
        keep = self.vouched(workers)
        return {p: r for p, r in workers.items() if p in keep}


@dataclass(frozen=True)
class Trust:
    """Whose word counts, at one moment, among the peers it was taken for (``Partners.trust``)."""

    me: str
    partners: frozenset[str]
    """This worker's partners among those peers."""
    alone: bool
    """It has partners, and saw one within ``absent_grace``: while none is among the peers asked about, its
    own word alone counts."""

    def vouched(self, peers: Iterable[str]) -> set[str]:
        """The peers whose word counts: its partners (and itself) among ``peers``. Where none of its partners is
        among them: itself alone for ``absent_grace`` since one was last seen (one may be restarting), then all
        of them (they have all left the run: it is a newcomer again, or it could never follow the run that went
        on without it); all of them at once if it never had a partner."""
        peers = set(peers)
        mine = peers & self.partners
        if mine:
            return mine | ({self.me} & peers)
        if self.alone:
            return {self.me} & peers
        return peers
