"""A peer of an open run that pushes matchmaking records to a worker (``swarm/pushed_records.py``).

It may push its own records (anyone may announce itself in an open run, through the DHT as well);
it tries to get others past the worker's checks, and writes what each push got to ``--out`` (JSON):

- forged: an announcement under the target's own peer id, signed with the attacker's key;
- redated: the attacker's own valid announcement with a later expiration than it signed;
- forever: its own announcement set to expire in ten days;
- worker: its own progress record, 10**6 steps ahead, pushed as if it were a round record;
- foreign: its own announcement under another run's key;
- too_many: more records in one push than a push may carry;
- oversized: a payload over the push limit;
- garbage: bytes that are not msgpack;
- flood: its own announcements under many round keys, in pushes of the most a push carries;
- own: one valid announcement of its own (the control: this one is kept).
"""

import asyncio

import attacker  # tests/swarm/attacker.py: this script's own folder is on the path
import msgpack
from hivemind.utils.timed_storage import get_dht_time

from opendiloco.comm.wire import Code
from opendiloco.swarm import records
from opendiloco.swarm.membership import Membership
from opendiloco.swarm.pushed_records import MAX_PUSH_BYTES, MAX_PUSH_RECORDS, PushedRecord, encode_push
from opendiloco.swarm.streams import P2PStreams


async def push(streams: P2PStreams, target: str, payload: bytes) -> str:
    try:
        stream = await asyncio.wait_for(streams.connect(target), 10)
        try:
            await stream.send(Code.GROUP, {"key": "7.0", "attempt": 0}, payload)
            await asyncio.sleep(0.2)
            return "sent"
        finally:
            stream.close()
    except Exception as e:  # the daemon's own errors
        return f"failed: {type(e).__name__}: {e}"


async def main_async(args) -> dict:
    dht, p2p = await attacker.join(args.peers_file)
    me = dht.identity.peer_id
    book = records.RunRecords(dht, Membership.open(args.run_id), dht.identity)
    streams = P2PStreams(p2p, f"opendiloco.{args.run_id}.match")
    key = book.round_key("7.0")
    exp = get_dht_time() + 60
    announcement = {"attempt": 0, "numel": 10, "codec": "fp16", "part": 1 << 18, "config": "", "since": get_dht_time()}

    def own(dht_key: str, value=announcement, expiration: float = exp) -> PushedRecord:
        return PushedRecord(dht_key, me, expiration, book._envelope(dht_key, value, expiration))

    signed = own(key)
    pushes = {
        "forged": [PushedRecord(key, args.target, exp, signed.envelope)],
        "redated": [PushedRecord(key, me, exp + 30, signed.envelope)],
        "forever": [own(key, expiration=get_dht_time() + 10 * 24 * 3600)],
        "worker": [own(book.workers_key(), records.WorkerRecord(peer_id=me, outer_step=10**6, time=get_dht_time())
                       .to_value())],
        "foreign": [own("another-run.round.7.0")],
        "too_many": msgpack.packb([own(key).to_wire()] * (MAX_PUSH_RECORDS + 1), use_bin_type=True),
        "oversized": b"\x90" + bytes(MAX_PUSH_BYTES),
        "garbage": b"\xc1\xc1\xc1 not msgpack",
    }
    report = {"peer_id": me, "round_key": key, "expiration_time": exp, "announcement": announcement, "sent": {}}
    for name, body in pushes.items():
        payload = body if isinstance(body, bytes) else encode_push(body)
        report["sent"][name] = await push(streams, args.target, payload)
    flood = [own(book.round_key(f"{1000 + i}.0")) for i in range(args.flood_keys)]
    report["flood"] = [await push(streams, args.target, encode_push(flood[i:i + MAX_PUSH_RECORDS]))
                       for i in range(0, len(flood), MAX_PUSH_RECORDS)]
    report["sent"]["own"] = await push(streams, args.target, encode_push([signed]))
    await attacker.leave(dht, p2p)
    return report


def main():
    p = attacker.arguments()
    p.add_argument("--target", required=True)
    p.add_argument("--flood-keys", type=int, default=300)
    attacker.run(main_async, p)


if __name__ == "__main__":
    main()
