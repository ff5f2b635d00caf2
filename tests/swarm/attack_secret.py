"""An outsider that guesses a closed run's secret offline from the tag every member publishes in plain.

Each member stores ``{"tag": Membership.tag}`` under ``{run_id}.secrets`` (signed, not sealed: so that
workers holding another secret are told). The tag is derived from the secret and the run id, so an
outsider that reads one can try candidates at its own pace, offline, until one gives the same tag. This
script reads the tags of ``--run-id`` from the DHT and tries ``--count`` candidates of a human pattern
(``--pattern``, formatted with 0, 1, 2, ...) for at most ``--budget`` seconds; it writes to ``--out``
(JSON) how many it tried, how many per second, and the secret if it found it.

``guess`` is also what the tests run.
"""

from __future__ import annotations

import time

from opendiloco.errors import SwarmError
from opendiloco.swarm.membership import Membership, RunSecret


def tag_of(candidate: bytes, run_id: str) -> str | None:
    """The tag a run of ``run_id`` with this secret publishes (what any member computes); None if no run
    could have it (a worker refuses it)."""
    try:
        return Membership(run_id, RunSecret(candidate, "a guess")).tag
    except SwarmError:
        return None


def guess(run_id: str, tags: set[str], candidates, budget_s: float) -> dict:
    """Tries ``candidates`` (bytes) in turn until one gives one of ``tags`` or ``budget_s`` is spent."""
    began, tried, found = time.perf_counter(), 0, None
    for candidate in candidates:
        if time.perf_counter() - began >= budget_s:
            break
        tried += 1
        if tag_of(candidate, run_id) in tags:
            found = candidate.decode(errors="replace")
            break
    spent = time.perf_counter() - began
    return {"tried": tried, "seconds": spent, "per_s": tried / spent if spent > 0 else 0.0, "found": found}


async def main_async(args) -> dict:
    import attacker  # tests/swarm/attacker.py: this script's own folder is on the path

    from opendiloco.swarm.records import RunRecords

    dht, p2p = await attacker.join(args.peers_file)
    book = RunRecords(dht, Membership.open(args.run_id))
    key = book.secret_key()
    found = dht.get(key, latest=True)
    tags = {v["tag"] for v in book.live_subkeys(key, found, 3600, sealed=False).values()
            if isinstance(v, dict) and isinstance(v.get("tag"), str)}
    await attacker.leave(dht, p2p)
    report = guess(args.run_id, tags, (args.pattern.format(i).encode() for i in range(args.count)), args.budget)
    return {"tags": sorted(tags), **report}


def main():
    import attacker

    p = attacker.arguments()
    p.add_argument("--pattern", default="the secret of run {:06d}")
    p.add_argument("--count", type=int, default=10**6)
    p.add_argument("--budget", type=float, default=60.0)
    attacker.run(main_async, p)


if __name__ == "__main__":
    main()
