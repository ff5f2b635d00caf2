"""The p2p protocols a worker's communicator speaks on its DHT node's daemon, each named in the run's
key namespace (and proven by its members in a closed run): ``reduce`` (a round's exchange), ``state``
(state for joiners), ``match`` (matchmaking pushes); behind NAT also ``hold`` (its relayed connections
kept open) and ``reverse`` (a public worker that cannot dial it asks it to dial back)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P

from .connectivity.relays import RelayLinks
from .connectivity.reservations import RelaySlots
from .connectivity.reversal import ConnectionReversal
from .membership import Membership
from .records import RunRecords
from .streams import P2PStreams


@dataclass
class Protocols:
    reduce: P2PStreams
    state: P2PStreams
    match: P2PStreams
    reversal: ConnectionReversal
    relay_links: RelayLinks | None
    """Behind NAT: the relayed connections to peers behind NAT, held open (None for a public worker)."""
    relay_slots: RelaySlots | None
    """Behind NAT: its slots on its relays (None for a public worker)."""


async def open_protocols(p2p: P2P, membership: Membership, records: RunRecords, relays: Sequence[str]) -> Protocols:
    """The protocols of a worker with slots on ``relays`` (behind NAT; none: a public worker). ``hold``
    and ``reverse`` are served here; the others are served by their users."""
    ns, m = membership.namespace, membership
    # Only a worker behind NAT dials through relays, and only one behind NAT is dialled that way (and
    # held); a public one uses the connection the other dialled out, and serves no holds.
    links = None
    if relays:
        hold_streams = P2PStreams(p2p, f"opendiloco.{ns}.hold", m)
        links = RelayLinks(records.relay_book, p2p, hold_streams.connect)
        await hold_streams.listen(links.serve_hold)
    slots = RelaySlots(p2p, relays) if links is not None else None
    # A public worker that cannot dial one behind NAT asks it through its relay to dial back; one behind
    # NAT serves those asks (a NAT'd peer is reached through relays: ``links``).
    reversal_streams = P2PStreams(p2p, f"opendiloco.{ns}.reverse", m)
    reversal = ConnectionReversal(p2p, reversal_streams, records.relay_book, records.address_book)
    if links is not None:
        await reversal_streams.listen(reversal.serve)
    book, dial_back = records.address_book, (None if links is not None else reversal)
    return Protocols(reduce=P2PStreams(p2p, f"opendiloco.{ns}.reduce", m, links, book, dial_back),
                     state=P2PStreams(p2p, f"opendiloco.{ns}.state", m, links, book, dial_back),
                     match=P2PStreams(p2p, f"opendiloco.{ns}.match", m, links, book, dial_back),
                     reversal=reversal, relay_links=links, relay_slots=slots)
