"""Every fixed timeout, grace and period of the library, in one table, and the relations between them.

A module reads its bounds from here (under the name it always used: ``from ..timeouts import
RELAY_DIAL_TIMEOUT as DIAL_TIMEOUT``), so that changing one shows what it must stay below or above:
``RELATIONS`` states, as data, which bound must stay below which and why, and ``check`` finds those a
table breaks (``tests/test_timeouts.py`` checks this one). A few rows are not ours but the daemon's
or hivemind's (``RELAY_SLOT_TTL_S``, ``RELAYED_CONNECTION_LIMIT_S``, ``HIVEMIND_REQUEST_TIMEOUT_S``):
nothing reads them, they are there for the relations. Clock offsets (``swarm/clock.py``) are
thresholds on a clock's error, not waits, and stay where they are read; so do the settings a run
configures (heartbeat, ``matchmaking_timeout``, ``record_ttl``).

Standard library only: the core, ``comm/`` and ``swarm/`` import it alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# -- not ours: the daemon's and hivemind's own bounds, stated for the relations below --

RELAY_SLOT_TTL_S = 3600.0
"""How long a relay (libp2p's circuit relay v2) keeps a slot it gave, unless asked again."""
RELAYED_CONNECTION_LIMIT_S = 120.0
"""How long a relay lets one relayed connection live (then it ends it)."""
HIVEMIND_REQUEST_TIMEOUT_S = 3.0
"""How long hivemind's DHT waits for one peer's answer to one request (its ping too)."""

# -- swarm/: the run's records and the round --

DHT_CALL_TIMEOUT = 30.0
"""A worker's wait for one call to its DHT process (a read or a store of the run's records)."""
GROUP_READ_GRACE = 2.0
"""A worker about to publish a group waits this long for a read of the attempt's groups still under way."""
PUSH_TIMEOUT_S = 5.0
"""A matchmaking push's stream opening, and a served push's arrival."""
STREAM_HELLO_TIMEOUT = 10.0
"""A p2p stream's first frame (who asks, proven) after it opened."""
ADDRS_TIMEOUT = 5.0
"""The daemon's answer to where it listens (before each heartbeat, and every ``ADDRS_EVERY_S``)."""
ADDRS_EVERY_S = 1.0
"""How often a worker looks where its daemon listens, beside the heartbeat.

A heartbeat's DHT store hangs on the dead connections of a worker whose address just changed (for 20 s
in the long scenario), and the move must be seen at once."""
MEMBER_VANISHED_S = 3.0
"""How long a member the exchange waits on may be gone from the records (and two reads) before it is given up on."""
LEAVE_TIMEOUT = 1.0
"""``close``'s wait for the record that tells the run this worker left (its peers stop waiting for it at once).

It goes out as soon as the worker is asked to stop, while the checkpoint is written; on a working network
it takes milliseconds. A DHT whose peers do not answer would keep it for seconds (hivemind's 3 s per
request): not waited for. Unannounced, a worker drops out of the run when its record expires
(``record_ttl``)."""
CLOSE_STEP_TIMEOUT = 1.0
"""``close``'s wait for each of its other steps (cancelling tasks, the p2p replica, the loop)."""

# -- swarm/connectivity/ --

FROZEN_SILENT_S = 2.0
"""A member the round waits on that sent nothing for this long is pinged."""
FROZEN_PING_TIMEOUT_S = 3.0
"""The longest an echo takes from a live daemon: many round trips of the slowest link, and a loaded machine."""
FROZEN_PING_EVERY_S = 1.0
"""The least time between two pings matchmaking sends one peer."""
FROZEN_FOUND_FOR_S = 10.0
"""How long a peer found frozen is neither waited for nor grouped with by matchmaking (pinged again then)."""
RELAYED_QUIET_S = 3.0
"""A peer behind NAT whose record is this old is asked by a ping in matchmaking.

A heartbeat and a half at the default 2 s: one whose record is fresher is alive, whatever a ping through
a relay says."""
DIAL_BACK_TIMEOUT = 3.0
"""One dial of the reachability check back to the asker's address (each port)."""
DIAL_BACK_PER_PEER_S = 10.0
"""The least time between two dial-back checks served to one asker."""
ADDRESS_DIAL_TIMEOUT = 10.0
"""A dial to the addresses a peer's record names."""
RELAY_DIAL_TIMEOUT = 10.0
"""A connection through a relay (and the hold stream on it, and closing a peer's connections)."""
RENEW_BEFORE_ROUND_S = 60.0
"""A held relayed connection older than this is replaced before a round begins."""
RESERVE_TIMEOUT = 10.0
"""One ask to a relay for this worker's slot (the RESERVE message and its answer)."""
RESERVE_EVERY_S = 30.0
"""How often a worker behind NAT asks its relays for its slot."""
RESERVE_RETRY_S = 5.0
"""How often it asks while a relay gives it none (down or restarting): the other workers behind NAT cannot
reach it there until it has one."""
RESERVE_AGAIN_S = 0.5
"""After a lost connection, the pause before a second ask for the slot when the first failed."""
RELAY_PING_TIMEOUT = 5.0
"""libp2p's ping to a relay (and the daemon's list of its peers) from a worker behind NAT."""
RELAY_WATCH_EVERY_S = 1.0
"""How often a worker behind NAT pings its relays."""
SILENT_RELAY_S = 30.0
"""A relay whose connection broke within this long of a ping it left unanswered froze: no sign of a move.

It froze and thawed, or its link was down. A router's move breaks connections that echoed just before."""
WIDEN_EVERY_S = 5.0
"""How often a worker behind NAT looks for public workers of the run to hold more slots on."""
OWN_CLOSE_GRACE_S = 10.0
"""After the worker closed its connections itself, a lost connection within this is no sign of a move."""
REDIAL_TIMEOUT = 10.0
"""One initial peer's answer to a redial (connect and ping, again on a new connection if the first found none)."""
REVERSAL_RELAY_DIAL_TIMEOUT = 5.0
"""A connection reversal's dial through the NAT'd worker's relay."""
REVERSAL_ANSWER_TIMEOUT = 5.0
"""A connection reversal's request and its answer, each."""
REVERSAL_DIRECT_WAIT_S = 5.0
"""The asker's wait for the direct connection after the answer."""
REVERSAL_MIN_INTERVAL_S = 5.0
"""The least time between two reversals with one peer (asked or served)."""

# -- swarm/state/ --

STATE_SERVE_WINDOW_S = 60.0
"""The window a donor counts one peer's downloads and part bytes in."""
STATE_CONNECT_TIMEOUT = 10.0
"""A joiner's stream to one donor: one it cannot reach within this is given up on, and the next asked.

Behind NAT, gone, partitioned: the next candidate gets its turn instead of one silent donor taking the
whole download's deadline."""
STATE_STALL_TIMEOUT = 20.0
"""A donor's next part once it started sending (frozen, or its link died, after that)."""
STATE_HEAD_TIMEOUT = 120.0
"""A donor's start of a whole download, beyond what its busy slots may take (``head_timeout``).

A request may queue while the donor serves others (its slots are few, each send bounded): a donor that
does not start within this, plus the time its busy slots may take for a state of the asked bound, is
given up on, and the next one asked."""
SNAPSHOT_KEEP_S = 120.0
"""A donor's cut of its state nobody used for this long is dropped."""
SNAPSHOT_FRESH_S = 2.0
"""A cut at the asked step this recent is served again instead of a new one."""
MANIFEST_TIMEOUT = 30.0
"""A donor's manifest (it cuts its state first: a copy and a digest of it, seconds for a large model)."""
MANIFEST_GRACE = 1.0
"""Once one manifest is in, the others get this long (or as long again as it took) before parts start."""

# -- comm/ --

GONE_POLL_S = 0.5
"""While a member is asked whether it completed a round, how often the asker looks whether it left the run."""
UNDIALLED_GONE_S = 3.0
"""A member asked about a round's outcome that no dial reached for this long (every dial failing) is gone.

A killed worker's address refuses at once: had it completed the round, its state is out of reach, and
its record would only say so once it expires (``record_ttl``, 8 s in the long scenario)."""
MIN_AUDIT_ANSWER_S = 5.0
"""The least time a member is given to answer an audit (``AuditingMember.answer_bound``).

The chunks are small and it has every part by then, but a loaded machine's event loop may lag."""

# -- pacing.py --

PACE_RETRY_S = 0.5
"""Under pace "swarm", the wait before a failed round is tried again (doubled at each failure in a row)."""
PACE_RETRY_MAX_S = 8.0
"""The longest wait before a failed round is tried again."""


@dataclass(frozen=True)
class Relation:
    """The sum of the bounds ``below`` (a name twice counts twice) must stay under ``above``, because of ``why``."""

    below: tuple[str, ...]
    above: str
    why: str


RELATIONS = (
    Relation(("RESERVE_EVERY_S",), "RELAY_SLOT_TTL_S", "a slot is asked for again long before the relay lets it lapse"),
    Relation(("RESERVE_RETRY_S",), "RESERVE_EVERY_S", "a worker that a relay gives no slot asks more often, not less"),
    Relation(("RENEW_BEFORE_ROUND_S",), "RELAYED_CONNECTION_LIMIT_S",
             "a round never starts on a relayed connection the relay is about to end"),
    Relation(("RELAY_WATCH_EVERY_S", "RELAY_PING_TIMEOUT", "RELAY_PING_TIMEOUT"), "SILENT_RELAY_S",
             "a relay that left a ping unanswered is still excused when its broken connection shows at the next look "
             "(a pause, the daemon's list of peers and the pings, each bounded)"),
    Relation(("RELAY_WATCH_EVERY_S",), "OWN_CLOSE_GRACE_S",
             "the watch's next look at its relays falls within the grace after it closed their connections itself"),
    Relation(("HIVEMIND_REQUEST_TIMEOUT_S", "HIVEMIND_REQUEST_TIMEOUT_S"), "REDIAL_TIMEOUT",
             "a redial has room for hivemind's ping twice (again on a new connection)"),
    Relation(("LEAVE_TIMEOUT",), "HIVEMIND_REQUEST_TIMEOUT_S",
             "closing does not wait out a DHT whose peers do not answer a request"),
    Relation(("GROUP_READ_GRACE",), "DHT_CALL_TIMEOUT",
             "a worker waits a read's round trips for the groups, not the whole bound of a DHT call"),
    Relation(("DIAL_BACK_TIMEOUT",), "DIAL_BACK_PER_PEER_S",
             "a dial-back (its ports at once) ends before the same asker may ask again: one per asker in flight"),
    Relation(("MANIFEST_GRACE",), "MANIFEST_TIMEOUT", "late manifests get a short grace, not a manifest's whole bound"),
    Relation(("SNAPSHOT_FRESH_S",), "SNAPSHOT_KEEP_S", "a cut recent enough to serve again is still kept"),
    Relation(("FROZEN_PING_EVERY_S",), "FROZEN_FOUND_FOR_S",
             "a peer's last ping is remembered longer than the spacing it sets (both are forgotten after the finding)"),
    Relation(("GONE_POLL_S",), "UNDIALLED_GONE_S", "the asker looks more often than the span that makes a member gone"),
    Relation(("PACE_RETRY_S",), "PACE_RETRY_MAX_S", "a retry's wait grows from its first value to its cap"),
)
"""Which bounds must stay below which, and why: ``check`` names those a table breaks."""


def table() -> dict[str, float]:
    """This module's bounds, by name."""
    return {name: value for name, value in globals().items() if name.isupper() and isinstance(value, float)}


def check(bounds: Mapping[str, float], relations: tuple[Relation, ...] = RELATIONS) -> list[Relation]:
    """The relations ``bounds`` breaks (a relation that names a bound ``bounds`` lacks is broken too)."""
    return [r for r in relations
            if any(name not in bounds for name in (*r.below, r.above))
            or not sum(bounds[name] for name in r.below) < bounds[r.above]]
