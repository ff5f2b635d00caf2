"""An outsider of a closed run: it knows a peer's address, and even the run's key and protocol
names (as if they had leaked), but not the secret. It tries everything a member does and writes
what it got to ``--out`` (JSON).

- read: the run's worker records, raw and through an open-run reader;
- publish: a progress record of its own (signed, but not sealed with the secret), 10**6 steps ahead;
- download: a worker's state, with no proof and with a made-up one;
- contribute: an opening of a round's stream; ring: a matchmaking doorbell.
"""

import asyncio
import time

import attacker  # tests/swarm/attacker.py: this script's own folder is on the path
from hivemind.utils.timed_storage import get_dht_time

from opendiloco.comm.wire import ByteStream, Code, Refused, StreamClosed
from opendiloco.swarm import records
from opendiloco.swarm.membership import Membership, RunSecret
from opendiloco.swarm.streams import P2PStreams


async def attempt(p2p, protocol: str, target: str, hello: dict | None, opening: tuple) -> str:
    """Opens a stream, sends ``hello`` (if any) and ``opening``; what the worker answered."""
    try:
        streams = P2PStreams(p2p, protocol)
        stream: ByteStream = await asyncio.wait_for(streams.connect(target), 10)
        try:
            if hello is not None:
                await stream.send(Code.HELLO, hello)
            await stream.send(*opening)
            frame = await asyncio.wait_for(stream.recv(max_payload=1 << 20), 15)
            return f"answered {frame.code.name}"
        finally:
            stream.close()
    except Refused as e:
        return f"refused: {e}"
    except (StreamClosed, asyncio.TimeoutError) as e:
        return f"closed: {type(e).__name__}"
    except Exception as e:  # the daemon's own errors
        return f"failed: {type(e).__name__}: {e}"


async def main_async(args) -> dict:
    dht, p2p = await attacker.join(args.peers_file)
    me = dht.identity.peer_id
    report = {"peer_id": me}

    # Read: the raw values under the real key, and what readers without the secret make of them.
    found = await dht.get(args.workers_key, latest=True, return_future=True)
    raw = [] if found is None or not isinstance(found.value, dict) else [item.value for item in found.value.values()]
    report["raw_records"] = len(raw)
    report["plaintext_seen"] = any(b"outer_step" in v for v in raw if isinstance(v, bytes))
    report["open_reader"] = len(records.RunRecords(dht, Membership.open(args.run_id)).read_workers())
    wrong = Membership(args.run_id, RunSecret(b"not-the-secret-of-this-run", "a guess"))
    report["wrong_secret_reader"] = len(records.RunRecords(dht, wrong).subkey_values(args.workers_key, 60))

    # Publish: its own record under the real key, far ahead (signed, so storage accepts it; not sealed).
    fake = records.WorkerRecord(peer_id=me, outer_step=10**6, global_hash="ffffffffffffffff", time=get_dht_time())
    book = records.RunRecords(dht, Membership.open(args.run_id), dht.identity)
    deadline = time.monotonic() + args.publish_for
    while time.monotonic() < deadline:
        await book.store_async(args.workers_key, fake.to_value(), get_dht_time() + 3600)
        await asyncio.sleep(1.0)

    # Streams, to every target worker.
    report["state"], report["contribute"], report["ring"] = [], [], []
    for target in args.targets:
        for hello in (None, {"proof": "0" * 64}):
            report["state"].append(await attempt(p2p, args.state_protocol, target, hello,
                                                 (Code.STATE_REQUEST, {"min_outer_step": None})))
            report["contribute"].append(await attempt(
                p2p, args.reduce_protocol, target, hello,
                (Code.CONTRIBUTE, {"group_id": "0" * 24, "sender": me, "weight": 1.0, "numel": 1, "parts": 1,
                                   "codec": "fp16|mean-clip4-w4"})))
            report["ring"].append(await attempt(p2p, args.match_protocol, target, hello,
                                                (Code.GROUP, {"key": "1", "attempt": 0})))
    await attacker.leave(dht, p2p)
    return report


def main():
    p = attacker.arguments()
    p.add_argument("--workers-key", required=True)
    p.add_argument("--state-protocol", required=True)
    p.add_argument("--reduce-protocol", required=True)
    p.add_argument("--match-protocol", required=True)
    p.add_argument("--targets", nargs="+", required=True)
    p.add_argument("--publish-for", type=float, default=5.0)
    attacker.run(main_async, p)


if __name__ == "__main__":
    main()
