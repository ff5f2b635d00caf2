"""This worker's clock against the run's: DHT records carry absolute times, and clocks differ.

A record's expiration time is checked by every DHT node that stores it and by every worker that
reads it, each against its own clock; ready times and round starts are compared across workers.
hivemind's DHT admits no node more than 3 s off its initial peer (``node.py`` turns that refusal
into one line), and records tolerate that much (``presence.CLOCK_SLACK``). What it does not catch is
a clock that drifts or jumps after the worker joined: its records then expire before anyone reads
them, or it sees everyone's as expired, and it trains on alone without a word.

So every worker publishes its raw clock with each heartbeat (``WorkerRecord.time``), and each
estimates its peers' offsets from the worker records it reads. A sample is taken when a record is
first seen with a new time: the record's time minus this clock, low by the time the record took to
reach this reader, never high; the largest of the last ``WINDOW_S`` seconds is the estimate. A
record that stops changing (a frozen or dead writer) gives no new samples, so it never looks like a
clock that falls behind. The median of the run's clocks (this one's counted as zero) beyond
``REPORT_S`` is said in one line. This worker's clock is not corrected: hivemind checks expirations
with the raw clock of each process anyway. What is corrected is a peer's time compared with this
clock, where the comparison is a wait or a pace (``in_mine``: a peer's ready time, the start of its
wait, when its pace figures were true), and only for a peer more than ``CORRECT_S`` off: within that,
an estimate this coarse (low by the age of the record when read) would move waits on every busy
read. Before, a worker 2.5 s ahead extrapolated its peers' work 2.5 s too far and entered every
round about 2.5 s of inner steps early, then waited (``skew.toml``).

A jump of this machine's clock (against its monotonic clock) is one line too. hivemind drops a record
whose expiration has passed by the raw clock of the process that decodes it, so after a jump of more
than a record's lifetime this worker may not see its peers at all: until a peer's record is read
again, ``isolated()`` says so, and the matchmaker refuses a round of one (it would fork θ_global from
the run's).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque

log = logging.getLogger(__name__)

WINDOW_S = 20.0
"""Seconds of samples an offset estimate is taken over."""

REPORT_S = 3.0
"""A median offset beyond this is told (hivemind's DHT admits a node this far off, no farther)."""

JUMP_S = 2.0
"""A change of wall clock against monotonic clock larger than this is a jump."""

ISOLATING_JUMP_S = 5.0
"""A jump larger than this may hide every peer's record (see ``isolated``)."""

CORRECT_S = 0.5
"""A peer whose clock is this far off (or more) has its times moved into this clock (``in_mine``)."""

MAX_PEERS = 1024
"""Peers whose offsets are tracked at once (a bound on what records can make this keep)."""


class RunClock:
    """This worker's clock, and its offset from the run's as estimated from peers' records. Thread-safe."""

    def __init__(self, *, wall=time.time, monotonic=time.monotonic):
        self._wall, self._monotonic = wall, monotonic
        self._lock = threading.Lock()
        self._samples: dict[str, deque] = {}
        self._last_seen: dict[str, float] = {}  # each peer's last published time, to sample only news
        self._offset = 0.0
        self._peers: dict[str, float] = {}  # each peer's clock minus this one, as last estimated
        self._told = 0.0  # the offset last reported in the log
        self._base = wall() - monotonic()
        self._jump: float | None = None  # the last jump, while no peer's record has been read since

    def now(self) -> float:
        """This machine's clock: what heartbeats publish, and what every record's expiration and ready
        time is written and compared in."""
        self._check_jump()
        return self._wall()

    @property
    def offset(self) -> float:
        """The run's clock minus this one (the median of the run's clocks), as last estimated."""
        return self._offset

    def isolated(self) -> str | None:
        """Why this worker may not see its peers (a jump of its clock, no record read since), or None."""
        self._check_jump()
        jump = self._jump
        if jump is None or abs(jump) <= ISOLATING_JUMP_S:
            return None
        return (f"this machine's clock jumped by {jump:+.0f} s and no peer's record has been read since: records "
                "look expired here; set the clock (NTP)")

    def observe(self, samples: dict[str, float]) -> None:
        """Peers' published raw clocks (peer id -> ``WorkerRecord.time``) as just read."""
        self._check_jump()
        local, mono = self._wall(), self._monotonic()
        with self._lock:
            if samples:
                self._jump = None
            for peer, their in samples.items():
                if not isinstance(their, (int, float)) or isinstance(their, bool) or not math.isfinite(their):
                    continue
                if self._last_seen.get(peer) == their:
                    continue  # seen already: a sample now would be staler than the first
                window = self._samples.get(peer)
                if window is None:
                    if len(self._samples) >= MAX_PEERS:
                        continue
                    window = self._samples[peer] = deque(maxlen=64)
                self._last_seen[peer] = float(their)
                window.append((mono, float(their) - local))
            self._recompute(mono)

    def in_mine(self, peer: str, t: float) -> float:
        """A time ``peer`` published (on its clock), on this clock: moved by the peer's estimated offset
        where that is ``CORRECT_S`` or more, else as it is."""
        with self._lock:
            off = self._peers.get(peer, 0.0)
        return t - off if abs(off) >= CORRECT_S else t

    def offsets(self) -> dict[str, float]:
        """Each tracked peer's clock minus this one's (the best recent estimate)."""
        with self._lock:
            return self._estimates(self._monotonic())

    def _estimates(self, mono: float) -> dict[str, float]:
        out = {}
        for peer, window in list(self._samples.items()):
            while window and window[0][0] < mono - WINDOW_S:
                window.popleft()
            if not window:
                del self._samples[peer]
                self._last_seen.pop(peer, None)
                continue
            out[peer] = max(offset for _, offset in window)
        return out

    def _recompute(self, mono: float) -> None:
        estimates = self._peers = self._estimates(mono)
        self._offset = statistics.median([0.0, *estimates.values()])
        off = self._offset if abs(self._offset) > REPORT_S else 0.0
        if abs(off - self._told) <= REPORT_S / 2:
            return
        if off:
            log.warning("this machine's clock is %.1f s %s the run's (the median of %d workers' clocks): records it "
                        "writes or reads may look expired, and its peers' ready times are off by as much; set the "
                        "clock (NTP)", abs(off), "behind" if off > 0 else "ahead of", len(estimates) + 1)
        else:
            log.info("this machine's clock agrees with the run's again")
        self._told = off

    def _check_jump(self) -> None:
        with self._lock:
            base = self._wall() - self._monotonic()
            jump, self._base = base - self._base, base  # slow slews (NTP) are followed, check by check
            if abs(jump) <= JUMP_S:
                return
            self._samples.clear()  # every sample was taken against the old clock
            self._last_seen.clear()
            self._peers = {}
            self._offset = self._told = 0.0
            self._jump = jump
        log.warning("this machine's clock jumped by %+.1f s; its offset from the run's is estimated afresh from its "
                    "peers' records", jump)
