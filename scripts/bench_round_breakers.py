"""What an insider costs: joint rounds per minute and loss of three honest workers, alone and with an
insider: by default one that sends one malformed part in every group it is in
(tests/swarm/attack_malformed.py); ``--attack`` names any attacker script of tests/swarm/ with its options.

    python scripts/bench_round_breakers.py [--seconds 60] [--malformed nan|short] [--dir DIR]
    python scripts/bench_round_breakers.py --attack attack_silent_owner.py --owner-result -1x --ask
    python scripts/bench_round_breakers.py --attack attack_breaker.py --breaks refuse

Runs both cases one after the other on 127.0.0.1 (the test worker, tests/swarm/worker.py, with the
settings of tests/swarm/test_round_breakers.py). A joint round is an outer step at which all three
honest workers hold the same θ_global from a completed round. Also prints each honest worker's failed
attempts with the insider in the group, failed rounds, and the longest gap between its completed rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from opendiloco.testing.proctree import ProcessGroup, spawn_bootstrap

ROOT = Path(__file__).resolve().parents[1]
WORKER, ATTACKER = ROOT / "tests/swarm/worker.py", ROOT / "tests/swarm/attack_malformed.py"
OPTS = ["--run-until-stopped", "--local-steps", "10", "--step-delay", "0.05", "--straggler-wait", "4",
        "--allreduce-timeout", "20", "--matchmaking-timeout", "60", "--min-group-size", "2"]


def run(tmp: Path, seconds: float, attack: list[str] | None) -> dict:
    group = ProcessGroup(tmp, cwd=ROOT)
    try:
        peers = tmp / "peers.txt"
        spawn_bootstrap(group, peers)
        for i in range(3):
            group.spawn([sys.executable, str(WORKER), "--peers-file", str(peers), "--out",
                         str(tmp / f"honest{i}.jsonl"), "--run-id", "bench", "--seed", str(i + 1), *OPTS], f"honest{i}")
        if attack:
            script, *options = attack
            group.spawn([sys.executable, str(ROOT / "tests/swarm" / script), *options, "--peers-file", str(peers),
                         "--out", str(tmp / "attacker.jsonl"), "--run-id", "bench", "--seed", "4", *OPTS], "attacker")
        time.sleep(seconds)
    finally:
        group.stop()
    return figures(tmp, seconds, attack is not None)


def figures(tmp: Path, seconds: float, attacked: bool) -> dict:
    def lines(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    bad = next((r["peer_id"] for r in lines(tmp / "attacker.jsonl") if r["event"] == "start"), None)
    syncs = [[r for r in lines(tmp / f"honest{i}.jsonl") if r["event"] == "sync"] for i in range(3)]
    held = [{r["outer_step"]: r["global_hash"] for r in rounds if r["ok"]} for rounds in syncs]
    joint = [k for k in held[0] if all(h.get(k) == held[0][k] for h in held[1:])]
    late = [r["loss"] for rounds in syncs for r in rounds[-5:] if r.get("loss") is not None]
    out = {"attacker": attacked, "seconds": seconds, "joint_rounds": len(joint),
           "joint_rounds_per_min": round(60 * len(joint) / seconds, 1),
           "late_loss": sum(late) / len(late) if late else None, "workers": []}
    for i, rounds in enumerate(syncs):
        ok = [r["time"] for r in rounds if r["ok"]]
        tries = lines(Path(str(tmp / f"honest{i}.jsonl") + ".attempts"))
        out["workers"].append({"rounds_ok": len(ok), "rounds_failed": sum(not r["ok"] for r in rounds),
                               "failed_attempts_with_insider": sum(not a["ok"] and bad in a["members"] for a in tries),
                               "longest_gap_s": round(max((b - a for a, b in zip(ok, ok[1:])), default=0.0), 1)})
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--malformed", default="nan", choices=["nan", "short"])
    p.add_argument("--dir", default=None, help="keep the logs here (default: a temporary folder)")
    p.add_argument("--attack", nargs=argparse.REMAINDER, default=None,
                   help="an attacker script of tests/swarm/ and its options (last on the line)")
    args = p.parse_args()
    attack = args.attack or [ATTACKER.name, "--malformed", args.malformed]
    base = Path(args.dir or tempfile.mkdtemp(prefix="round-breakers-"))
    for name, insider in (("alone", None), ("attacked", attack)):
        print(json.dumps(run(base / name, args.seconds, insider)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
