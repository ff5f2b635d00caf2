"""What the attacker scripts beside this file share: their command line and their JSON report.

Each script is run as a program (its folder is then on the path): ``attacker.run(main_async, parser)``
parses the options, runs the attack and writes what it got to ``--out``.
"""

import argparse
import asyncio
import json
import time


def arguments() -> argparse.ArgumentParser:
    """The options every attacker takes: where the run is, which run, where the report goes."""
    p = argparse.ArgumentParser()
    p.add_argument("--peers-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--run-id", required=True)
    return p


def insider_arguments() -> argparse.ArgumentParser:
    """An insider's options besides: the run's settings fingerprint and record lifetime (its records look normal)."""
    p = arguments()
    p.add_argument("--config", default="")
    p.add_argument("--record-ttl", type=float, default=4.0, help="the run's record_ttl")
    return p


async def join(peers_file: str):
    """The attacker's own DHT node, joined through the run's peers (one per line in ``peers_file``), and
    its p2p daemon."""
    from opendiloco.swarm.daemon.node import start_dht

    with open(peers_file) as f:
        peers = f.read().split()
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    return dht, await dht.replicate_p2p()


async def joint_round(book, besides: str | None = None, timeout: float = 120.0) -> dict:
    """Waits for the run to have done a joint round (two or more workers, ``besides`` this one, past outer
    step 1 with a θ_global hash): their records, by peer id."""
    deadline = time.monotonic() + timeout
    while True:
        honest = {p: r for p, r in book.read_workers(60).items()
                  if p != besides and r.outer_step >= 1 and r.global_hash}
        if len(honest) >= 2:
            return honest
        assert time.monotonic() < deadline, "the honest workers never got to outer step 1"
        await asyncio.sleep(0.5)


async def leave(dht, p2p) -> None:
    """Stops what ``join`` started: the p2p daemon, then the DHT node."""
    await p2p.shutdown()
    dht.shutdown()


def run(main_async, parser: argparse.ArgumentParser) -> None:
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    with open(args.out, "w") as f:
        json.dump(report, f)
