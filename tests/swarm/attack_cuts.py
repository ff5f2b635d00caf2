"""A member (or several identities of one) that makes a state donor hold many copies of its state.

A donor cuts its state (a full copy, ``state/layout.py``: ``Snapshot``) to serve a manifest, and keeps the
cut while parts of it are sent. This attacker asks ``--target`` for manifests, each with another part
size (``--part-sizes``, MiB), and after each one asks for parts of that cut that it never reads,
holding their streams open for ``--hold`` seconds (a slow reader). Writes to ``--out`` (JSON) how
many manifests it got, how many were refused, and how many part streams it held.

``hold_cuts`` is also what the tests run, from as many identities (p2p nodes) as they like.
"""

from __future__ import annotations

import asyncio

from opendiloco.comm.wire import Code
from opendiloco.errors import ProtocolError
from opendiloco.swarm.state.multi_donor import fetch_manifest
from opendiloco.swarm.state.transfer import PART_STREAMS_PER_PEER
from opendiloco.swarm.streams import P2PStreams


async def hold_cuts(streams: P2PStreams, donor: str, outer_step: int, part_sizes: list[int], held: list,
                    max_bytes: int = 1 << 34) -> dict:
    """Asks for one manifest per part size, and for parts of each cut it gets, never reading them: the
    streams go to ``held`` (the caller closes them). A donor serves one peer ``PART_STREAMS_PER_PEER``
    parts at a time: more identities pin more cuts."""
    report = {"manifests": 0, "refused": 0, "parts_held": 0}
    for part_bytes in part_sizes:
        try:
            manifest = await fetch_manifest(streams, donor, outer_step, part_bytes, max_bytes)
        except ProtocolError:
            report["refused"] += 1
            continue
        report["manifests"] += 1
        for index in range(min(PART_STREAMS_PER_PEER, len(manifest.digests))):
            stream = await streams.connect(donor)
            await stream.send(Code.STATE_PART_REQUEST, {
                "outer_step": manifest.outer_step, "part_bytes": manifest.part_bytes, "index": index,
                "digest": manifest.digests[index].hex()})
            held.append(stream)
            report["parts_held"] += 1
    return report


async def main_async(args) -> dict:
    import attacker  # tests/swarm/attacker.py: this script's own folder is on the path

    from opendiloco.swarm.membership import Membership, RunSecret

    dht, p2p = await attacker.join(args.peers_file)
    membership = Membership(args.run_id, RunSecret.from_environment())
    streams = P2PStreams(p2p, f"opendiloco.{membership.namespace}.state", membership=membership)
    held: list = []
    report = await hold_cuts(streams, args.target, args.outer_step, [mib << 20 for mib in args.part_sizes], held)
    await asyncio.sleep(args.hold)
    for stream in held:
        stream.close()
    await attacker.leave(dht, p2p)
    return report


def main():
    import attacker

    p = attacker.arguments()
    p.add_argument("--target", required=True)
    p.add_argument("--outer-step", type=int, required=True)
    p.add_argument("--part-sizes", type=int, nargs="+", default=[1, 3, 5, 7])
    p.add_argument("--hold", type=float, default=60.0)
    attacker.run(main_async, p)


if __name__ == "__main__":
    main()
