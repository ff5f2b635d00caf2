"""An insider of a closed run (it was given the secret) that tries to take the run over or stall it.

- **takeover**: downloads a worker's state (a member may), sets θ_global to 1000, serves that
  and publishes a progress record one outer step ahead of the run; leaving, it publishes one
  10**6 steps ahead, set to live an hour;
- **impersonation**: signs records with its own key and files them under an honest worker's
  peer id: that worker "far ahead", and groups "published by" it that leave the others out;
- **stall**: announces that it heads for the run's next round, to be ready in an hour, and never comes;
- **hammer**: opens ``--hammer`` state downloads at once from one worker.

Writes what it got to ``--out`` (JSON). The takeover lasts a third of ``--duration`` seconds and the
stall the rest; with ``--phase-rounds N``, each ends sooner, once the run has done N rounds under it.
"""

import asyncio
import io
import json
import time

import attacker  # tests/swarm/attacker.py: this script's own folder is on the path
import torch
from hivemind.utils.timed_storage import get_dht_time

from opendiloco.comm.wire import Refused
from opendiloco.swarm import records, signing
from opendiloco.swarm.daemon.node import start_dht
from opendiloco.swarm.membership import Membership, RunSecret
from opendiloco.swarm.state.transfer import StateServer, fetch_state
from opendiloco.swarm.streams import P2PStreams


async def hammer(streams: P2PStreams, target: str, n: int) -> dict:
    async def one():
        try:
            await fetch_state(streams, target, None, 1 << 30)
            return "served"
        except Refused as e:
            return f"refused: {str(e).split('refused: ', 1)[-1]}"
        except Exception as e:
            return f"failed: {type(e).__name__}"

    outcomes = await asyncio.gather(*(one() for _ in range(n)))
    return {o: outcomes.count(o) for o in set(outcomes)}


def forged(identity, key: str, victim: str, expiration: float, value, membership: Membership) -> bytes:
    """An envelope signed with our key but filed under ``victim``'s peer id."""
    body = membership.seal(json.dumps(value).encode(), signing.key_id(key) + victim.encode())
    envelope = identity.envelope(key, identity.peer_id, expiration, body)
    return envelope  # stored under the victim's subkey below: the signature then names the wrong peer


async def main_async(args) -> dict:
    with open(args.peers_file) as f:
        peers = f.read().split()
    membership = Membership(args.run_id, RunSecret.from_environment())
    assert membership.closed, "the insider needs the run secret in its environment"
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    p2p = await dht.replicate_p2p()
    me = dht.identity.peer_id
    book = records.RunRecords(dht, membership, dht.identity)
    state_streams = P2PStreams(p2p, f"opendiloco.{membership.namespace}.state", membership)
    report: dict = {"peer_id": me}

    # Wait for the run to have done a round, then download the state of its most advanced worker.
    honest = await attacker.joint_round(book, besides=me)
    donor = max(honest.values(), key=lambda r: r.outer_step)
    state = await fetch_state(state_streams, donor.peer_id, None, 1 << 30)
    report["downloaded_outer_step"] = state["outer_step"]

    # Takeover: a poisoned state, one outer step ahead, served to whoever asks.
    for g in state["outer"]["global_params"]:
        g.fill_(1000.0)
    state["outer_step"] = donor.outer_step + 1
    buf = io.BytesIO()
    torch.save(state, buf)
    server = StateServer(state_streams)
    server.provider = lambda: torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    await server.listen()

    victim = sorted(honest)[0]
    report["forged_stores"] = []
    report["hammer"] = await hammer(state_streams, donor.peer_id, args.hammer)
    began = time.monotonic()
    deadline, takeover_until = began + args.duration, began + args.duration / 3
    phase, phase_from = "takeover", None  # phase_from: the run's outer step when the phase began
    while time.monotonic() < deadline:
        now = get_dht_time()
        run = {p: r for p, r in book.read_workers(60).items() if p != me}
        top = max([r.outer_step for r in run.values()] + [0])
        phase_from = top if phase_from is None else phase_from
        rounds_done = bool(args.phase_rounds) and top >= phase_from + args.phase_rounds
        if phase == "takeover" and (rounds_done or time.monotonic() >= takeover_until):
            phase, phase_from = "stall", top
        elif phase == "stall" and rounds_done:
            break
        if phase == "takeover":
            # Takeover: one step ahead of the run with a hash nobody else holds (the poisoned state).
            mine = records.WorkerRecord(peer_id=me, outer_step=top + 1, global_hash="a" * 16, time=now,
                                        config=args.config)
            await book.store_async(book.workers_key(), mine.to_value(), now + args.record_ttl)
        else:
            # Stall: heading for the run's next round, "ready in an hour", never coming.
            mine = records.WorkerRecord(peer_id=me, outer_step=top, next_round=top, global_hash="a" * 16,
                                        ready_at=now + 3600, time=now, config=args.config)
            await book.store_async(book.workers_key(), mine.to_value(), now + args.record_ttl)
        # Impersonation: the victim far ahead, and groups in its name that hold only itself.
        fake = records.WorkerRecord(peer_id=victim, outer_step=10**6, global_hash="b" * 16, time=now)
        for key, value in [(book.workers_key(), fake.to_value())] + [
                (book.group_key(f"{k}.0", a), [victim]) for k in range(top, top + 3) for a in range(2)]:
            envelope = forged(dht.identity, key, victim, now + 3600, value, membership)
            ok = await dht.store(key, envelope, now + 3600, subkey=victim, return_future=True)
            report["forged_stores"].append(bool(ok))
        # Groups of our own that leave everyone else out, for the next rounds.
        for k in range(top, top + 3):
            await book.store_async(book.round_key(f"{k}.0"), {"attempt": 0, "numel": 1, "codec": "x", "part": 1,
                                                       "config": args.config, "since": now}, now + 600)
            await book.store_async(book.group_key(f"{k}.0", 0), [me], now + 600)
        await asyncio.sleep(1.0)
    # Leaving: a record 10**6 steps ahead, set to live an hour (it would stall every round after us).
    now = get_dht_time()
    farewell = records.WorkerRecord(peer_id=me, outer_step=10**6, global_hash="a" * 16, ready_at=now + 3600,
                                    time=now, config=args.config)
    await book.store_async(book.workers_key(), farewell.to_value(), now + 3600)
    report["served_poisoned"] = len(server._served.get(victim, ())) + sum(
        len(v) for p, v in server._served.items() if p != victim)
    await attacker.leave(dht, p2p)
    return report


def main():
    p = attacker.insider_arguments()
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--phase-rounds", type=int, default=0)
    p.add_argument("--hammer", type=int, default=12)
    attacker.run(main_async, p)


if __name__ == "__main__":
    main()
