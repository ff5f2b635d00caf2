"""The p2p daemons started here dial from ephemeral ports, not from the port they listen on.

go-libp2p's TCP transport binds every outgoing connection to its listen port (SO_REUSEPORT) unless
``LIBP2P_TCP_REUSEPORT`` is false. Two public workers that listen on the same port (31337, the
default of every worker) and dial each other at about the same time then send two SYNs for one and
the same 4-tuple: TCP's simultaneous open makes one connection of them, on which both ends start the
security handshake as its initiator, and both dials fail ("failed to negotiate security protocol:
noise: message is too short", or its deadline). Each daemon then backs the other's address off for
5 s and more. Workers that start together, or that all dial a moved worker's new address at once,
do exactly that: in the world scenarios with 60-75 ms between regions, a worker was left out of the
first 4-10 rounds (the others saw "could not dial ... dial backoff"). From an ephemeral port every
dial is a 4-tuple of its own.

Reusing the listen port would matter for hole punching through a NAT, which this project does not
rely on: a worker behind NAT is reached through relays (``relays.py``, ``reversal.py``).
"""

from __future__ import annotations

import os

REUSEPORT_ENV = "LIBP2P_TCP_REUSEPORT"


def dial_from_ephemeral_ports() -> None:
    """Makes the daemons this process starts from now on dial from ephemeral ports (a value the user
    set in the environment wins)."""
    os.environ.setdefault(REUSEPORT_ENV, "false")
