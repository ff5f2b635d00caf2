"""An insider with many identities (keys are free): one p2p node, and bare keys that sign records.

In three phases of ``--duration / 3`` each (with ``--phase-rounds N``, a phase ends sooner, once the
run has done N rounds under it):

- **takeover**: ``--keys`` identities publish progress records one outer step ahead of the run,
  all for the hash of a poisoned state (θ_global = 1000) that its p2p node serves to whoever asks;
- **stall**: new identities every second, heading for the run's next round (and the one after)
  and "ready in an hour";
- **pace**: new identities three times a second, heading for the run's next round (and the one
  after), "ready" with 10**12 samples of work (under ``pace = "swarm"`` that would end every honest
  round at once).

Writes the phases' times (``time.time()``) and what was served to ``--out`` (JSON).
"""

import asyncio
import io
import time

import attacker  # tests/swarm/attacker.py: this script's own folder is on the path
import torch
from hivemind.utils.timed_storage import get_dht_time

from opendiloco.outer import tensors_hash
from opendiloco.swarm import records
from opendiloco.swarm.daemon.node import start_dht
from opendiloco.swarm.membership import Membership, RunSecret
from opendiloco.swarm.signing import Identity
from opendiloco.swarm.state.transfer import StateServer, fetch_state
from opendiloco.swarm.streams import P2PStreams


def bare_key() -> Identity:
    return Identity.fresh()


async def main_async(args) -> dict:
    with open(args.peers_file) as f:
        peers = f.read().split()
    membership = Membership(args.run_id, RunSecret.from_environment())
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    p2p = await dht.replicate_p2p()
    book = records.RunRecords(dht, membership, dht.identity)
    streams = P2PStreams(p2p, f"opendiloco.{membership.namespace}.state", membership)
    report: dict = {"peer_id": dht.identity.peer_id, "identities": [dht.identity.peer_id]}

    def run_top() -> int:
        run = [r for p, r in book.read_workers(60).items() if p not in report["identities"]]
        return max([r.outer_step for r in run] + [0])

    def done(began_at: int, top: int) -> bool:
        """With ``--phase-rounds N``: the run has done N rounds since the phase began."""
        return bool(args.phase_rounds) and top >= began_at + args.phase_rounds

    async def publish(identity: Identity, record: records.WorkerRecord, ttl: float) -> None:
        signer = records.RunRecords(dht, membership, identity)
        await signer.store_async(signer.workers_key(), record.to_value(), get_dht_time() + ttl)

    honest = await attacker.joint_round(book)  # the run's workers are partners now
    donor = max(honest.values(), key=lambda r: r.outer_step)
    state = await fetch_state(streams, donor.peer_id, None, 1 << 30)

    phase = args.duration / 3
    keys = [dht.identity] + [bare_key() for _ in range(args.keys - 1)]
    report["identities"] += [k.peer_id for k in keys[1:]]
    server = StateServer(streams)
    report["takeover"] = [time.time(), None]
    end, began_at = time.monotonic() + phase, run_top()
    while time.monotonic() < end:
        top = run_top()
        if done(began_at, top):
            break
        if state["outer_step"] != top + 1:  # a poisoned state one step ahead of the run, and its real hash
            for g in state["outer"]["global_params"]:
                g.fill_(1000.0)
            state["outer_step"] = top + 1
            poison_hash = tensors_hash(state["outer"]["global_params"])
            buf = io.BytesIO()
            torch.save(state, buf)
            if server.provider is None:
                await server.listen()
            server.provider = lambda raw=buf.getvalue(): torch.load(io.BytesIO(raw), weights_only=True)
        for key in keys:
            await publish(key, records.WorkerRecord(peer_id=key.peer_id, outer_step=top + 1, global_hash=poison_hash,
                                                    time=get_dht_time(), config=args.config), args.record_ttl)
        await asyncio.sleep(0.5)
    report["takeover"][1] = time.time()

    for kind in ("stall", "pace"):
        report[kind] = [time.time(), None]
        end, began_at = time.monotonic() + phase, run_top()
        while time.monotonic() < end:
            top, now = run_top(), get_dht_time()
            if done(began_at, top):
                break
            for heading in (top, top + 1):  # the run's next round, and the one after it
                key = bare_key()
                report["identities"].append(key.peer_id)
                if kind == "stall":
                    record = records.WorkerRecord(peer_id=key.peer_id, outer_step=heading, next_round=heading,
                                                  ready_at=now + 3600, time=now, config=args.config)
                else:
                    record = records.WorkerRecord(peer_id=key.peer_id, outer_step=heading, next_round=heading,
                                                  ready=True, round_work=1e12, work_rate=1e6, work_per_step=1.0,
                                                  pace_time=now, time=now, config=args.config)
                await publish(key, record, args.record_ttl)
            await asyncio.sleep(1.0 if kind == "stall" else 0.3)
        report[kind][1] = time.time()
    report["served"] = sum(len(v) for v in server._served.values())
    await attacker.leave(dht, p2p)
    return report


def main():
    p = attacker.insider_arguments()
    p.add_argument("--keys", type=int, default=3)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--phase-rounds", type=int, default=0)
    attacker.run(main_async, p)


if __name__ == "__main__":
    main()
