"""Whose word counts: the peers that have completed a round with this worker.

A fresh identity costs nothing (a key; in a closed run, the secret once), so a vote, a pace or a
ready time from one is cheap to forge many times over. Completing a round with this worker is not
free: the peer sent its part of every shard, reduced its own shard correctly enough to pass every
member's checks, and held the run's θ_global. So once a worker has partners, only their records
(and its own) decide whether it catches up, has drifted or was left behind by the run, only their
paces set its round's target, and only their ready times (or those of peers that just downloaded
its state to join) are believed in full by its matchmaking (any other peer's for one
``straggler_wait`` at most).

A worker with no live partner (it has just started, resumed, only ever trained alone, or all its
partners have left) trusts the run's records as a joiner must: that first contact is where an open
run's Sybils, or a closed run's insider with many keys, can still outvote the honest workers.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping

MAX_PARTNERS = 4096
"""Remembered at most (the oldest forgotten first): a bound on memory, not on the run's size."""


class Partners:
    """The peers that completed a round with this worker (thread-safe, bounded)."""

    def __init__(self, me: str, limit: int = MAX_PARTNERS):
        self.me, self.limit = me, limit
        self._peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, members: Iterable[str]) -> None:
        """Members of a round this worker completed (applied) with them."""
        with self._lock:
            for peer in members:
                if peer != self.me:
                    self._peers[peer] = None
                    self._peers.move_to_end(peer)
            while len(self._peers) > self.limit:
                self._peers.popitem(last=False)

    def __contains__(self, peer: str) -> bool:
        with self._lock:
            return peer in self._peers

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def vouched(self, peers: Iterable[str]) -> set[str]:
        """The peers whose word counts: its partners (and itself) among ``peers``; all of them where
        none of its partners is among them (it has none yet, or they have all left the run: then it
        is a newcomer again, or it could never follow the run that went on without it)."""
        with self._lock:
            peers = set(peers)
            mine = {p for p in peers if p in self._peers}
            return mine | ({self.me} & peers) if mine else peers

    def voters(self, workers: Mapping) -> dict:
        """``workers`` (records by peer id) without the peers whose word does not count."""
        keep = self.vouched(workers)
        return {p: r for p, r in workers.items() if p in keep}
