"""A bad state donor for tests: a peer of the run that says it is ahead, then serves its state badly.

``--mode stall``: takes the state request and never answers (a donor on a dead-slow link).
``--mode die``: announces a state (or a manifest of one), sends its first MiB, and exits (a donor
killed mid-download).
``--mode poison``: an insider that votes with the run: it downloads the state of a worker at
``--outer-step`` (or later), publishes that worker's record as its own (same outer step, θ_global
hash and settings), and serves that state with one field corrupted (``--poison``, see ``POISONS``;
θ_global is left alone, so the state passes the run's hash). ``{marker}.live`` holds the other
workers it sees, one peer id a line, refreshed every heartbeat.
Each state request it takes is written to ``--marker`` first, so the test knows the download began.
"""

import argparse
import asyncio
import io
import os

import torch
from hivemind.utils.timed_storage import get_dht_time

from opendiloco.comm.wire import Code
from opendiloco.swarm import records
from opendiloco.swarm.daemon.node import start_dht
from opendiloco.swarm.membership import Membership
from opendiloco.swarm.state.layout import snapshot
from opendiloco.swarm.state.transfer import StateServer, fetch_state
from opendiloco.swarm.streams import P2PStreams

RECORD_TTL = 4.0
# The poisoner must stay the run's donor while the honest worker is stopped: its record lives long
# enough that a heartbeat delayed on a loaded machine never leaves the run looking empty (a joiner
# accepts records up to its own record_ttl plus the clock slack, 14 s in tests/swarm/worker.py).
POISONER_TTL = 12.0


def _momentum_buffers(state):
    return [entry["momentum_buffer"] for entry in state["outer"]["optimizer"]["state"].values()
            if isinstance(entry.get("momentum_buffer"), torch.Tensor)]


def _settings(state, name, value):
    for group in state["outer"]["optimizer"]["param_groups"]:
        group[name] = value(group[name])


POISONS = {
    "inner_steps_total": lambda s: s.update(inner_steps_total=10**9),  # the joiner skips 1e9 steps of data
    "local_step": lambda s: s.update(local_step=10**12),
    "lr": lambda s: _settings(s, "lr", lambda lr: lr * 100),
    "maximize": lambda s: _settings(s, "maximize", lambda _: True),
    "momentum": lambda s: _settings(s, "momentum", lambda _: 0.999),
    "momentum_buffer": lambda s: [b.fill_(1e30) for b in _momentum_buffers(s)],
    "buffers": lambda s: [b.fill_(float("inf")) for b in s.get("buffers", [])],
}
"""What an insider can corrupt in a state whose θ_global the run confirms (a state dict, in place)."""


def poison(state: dict, field: str) -> dict:
    POISONS[field](state)
    return state


async def serve(args, stream) -> None:
    request = await stream.recv(max_payload=0, expect=(Code.STATE_REQUEST, Code.STATE_MANIFEST_REQUEST,
                                                       Code.STATE_PART_REQUEST))
    with open(args.marker, "a") as f:
        f.write("request\n")
    if args.mode == "stall":
        await asyncio.sleep(3600)
    if request.code == Code.STATE_MANIFEST_REQUEST:  # a state of 4 MiB, in the asked parts
        fake = snapshot({"outer_step": args.outer_step, "blob": torch.zeros(1 << 20)}, request.meta["part_bytes"])
        await stream.send(Code.STATE_MANIFEST, {"outer_step": args.outer_step, "size": fake.size},
                          fake.manifest_payload())
        return
    if request.code == Code.STATE_PART_REQUEST:  # the first MiB of the part, then gone
        await stream.send(Code.STATE_PART, None, b"\0" * (1 << 20))
        await asyncio.sleep(0.2)
        os._exit(0)
    size = 4 << 20
    await stream.send(Code.STATE, {"size": size, "outer_step": args.outer_step, "digest": "0" * 64})
    await stream.send(Code.STATE_PART, None, b"\0" * (1 << 20))
    await asyncio.sleep(0.2)
    os._exit(0)  # mid-download; the DHT process and p2pd follow (WorkerBoundDHT)


async def serve_poisoned(args, dht, p2p, book) -> None:
    """Mirrors an honest worker's record, serving its state with ``args.poison`` corrupted."""
    peer_id = dht.peer_id.to_base58()
    streams = P2PStreams(p2p, f"opendiloco.{args.run_id}.state")
    while True:
        honest = [r for p, r in book.read_workers(60).items() if p != peer_id and r.outer_step >= args.outer_step
                  and r.global_hash]
        if honest:
            break
        await asyncio.sleep(0.5)
    donor = max(honest, key=lambda r: r.outer_step)
    state = await fetch_state(streams, donor.peer_id, None, 1 << 30)
    assert state["outer_step"] == donor.outer_step, "the honest worker moved on while we downloaded"
    state.pop("donor", None)
    buf = io.BytesIO()
    torch.save(poison(state, args.poison), buf)

    def provider():
        with open(args.marker, "a") as f:
            f.write("request\n")
        return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)

    server = StateServer(streams)
    server.provider = provider
    await server.listen()
    mirror = donor.to_value()

    async def watch():  # off the heartbeat's path: a slow read never delays a store
        while True:
            others = [p for p in await asyncio.to_thread(book.read_workers, 60) if p != peer_id]
            with open(args.marker + ".live.tmp", "w") as f:
                f.write("\n".join(others))
            os.replace(args.marker + ".live.tmp", args.marker + ".live")
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    while not watcher.done():  # a heartbeat: the honest worker's claim, as our own
        mirror["time"] = get_dht_time()
        await book.store_async(book.workers_key(), mirror, get_dht_time() + POISONER_TTL)
        with open(args.marker + ".up", "w") as f:
            f.write(peer_id)
        await asyncio.sleep(1.0)
    watcher.result()  # a failed watcher is this script's error, not a silent stop


async def main_async(args) -> None:
    with open(args.peers_file) as f:
        peers = f.read().split()
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer_id = dht.peer_id.to_base58()
    p2p = await dht.replicate_p2p()
    book = records.RunRecords(dht, Membership.open(args.run_id), dht.identity)
    if args.mode == "poison":
        return await serve_poisoned(args, dht, p2p, book)
    await P2PStreams(p2p, f"opendiloco.{args.run_id}.state").listen(lambda stream: serve(args, stream))
    while True:  # a heartbeat, as a live worker's
        rec = records.WorkerRecord(peer_id=peer_id, outer_step=args.outer_step, inner_step=4 * args.outer_step,
                                   time=get_dht_time(), config=args.config, global_hash="0123456789abcdef")
        await book.store_async(book.workers_key(), rec.to_value(), get_dht_time() + RECORD_TTL)
        with open(args.marker + ".up", "w") as f:
            f.write(peer_id)
        await asyncio.sleep(1.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peers-file", required=True)
    p.add_argument("--run-id", default="opendiloco")
    p.add_argument("--mode", choices=["stall", "die", "poison"], required=True)
    p.add_argument("--poison", choices=sorted(POISONS), default="inner_steps_total",
                   help="--mode poison: the field of the state it corrupts")
    p.add_argument("--marker", required=True)
    p.add_argument("--config", default="", help="the config fingerprint to publish")
    p.add_argument("--outer-step", type=int, default=5,
                   help="the outer step it claims (--mode poison: the least outer step of the state it serves)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
