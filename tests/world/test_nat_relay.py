"""Workers behind NAT take full part in rounds with a public worker, whatever the model's size.

``benchmarks/scenarios/natmix.toml``: a public worker and two workers behind two different
masquerading routers, in client mode; every round must hold all three (min group 3). The two
behind NAT accept no connection: what they send each other goes through the bootstrap's relay,
which carries at most 128 KiB per connection each way (``opendiloco.swarm.connectivity.relays``), and the model
(~0.4M parameters, ~260 kB of fp16 per third) is too large for a third of it to cross there. So
they own no shard (``shard_bounds_for``): their bulk goes to the public worker, and only small frames
cross the relay. Both contribute to every round the run applies, on one θ_global, and all end cleanly.
Behaviour only, never timings.

Needs root, iproute2 and iptables (skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from opendiloco.testing.scenario import load_scenario
from opendiloco.testing.scenario_report import analyse, summary
from opendiloco.testing.scenario_runner import ScenarioRunner
from opendiloco.testing.world import unavailable_reason
from opendiloco.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.world, pytest.mark.timeout(400)]


def test_workers_behind_two_nats_take_part_in_every_round_with_a_public_one(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    scenario = load_scenario(ROOT / "benchmarks" / "scenarios" / "natmix.toml")
    assert sum(w.nat for w in scenario.workers) == 2 and scenario.overrides["swarm.min_group_size"] == 3
    runner = ScenarioRunner(scenario, tmp_path / "natmix", prefix=f"odnr{os.getpid() % 10000}")
    out = runner.run()
    report = analyse(out, max_wait=600.0)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted((out / "logs").glob("*.log")))
    detail = f"{summary(report)}\n{logs}"

    assert report["tracebacks"] == 0, detail
    assert report["outer_steps"] >= scenario.settle_rounds, detail
    assert not report["hash_agreement"]["disagreements"], detail
    assert report["full_rounds"] == report["outer_steps"], detail  # every applied round held all three
    for name, w in report["workers"].items():
        assert w["rounds_in"] == w["rounds_ready"] > 0 and w["contributed_steps"] > 0, (name, detail)
        assert w["exit_codes"] and w["exit_codes"][-1] == 0, (name, detail)


def test_workers_behind_two_nats_reach_each_other_through_a_public_worker_once_their_relay_is_gone(tmp_path):
    """``natrelays.toml``: natmix's world, with the bootstrap (the NAT'd workers' one initial peer, so their
    one relay) killed for good mid-run. Each worker behind NAT also holds a slot on the public worker
    (``reservations.widen``) and its record names it, so rounds of all three go on. Before, the two NAT'd
    workers could not dial each other once it was gone, and no round of three was applied after."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    scenario = load_scenario(ROOT / "benchmarks" / "scenarios" / "natrelays.toml")
    killed_at = next(e.at for e in scenario.events if e.action == "kill_bootstrap")
    runner = ScenarioRunner(scenario, tmp_path / "natrelays", prefix=f"odnb{os.getpid() % 10000}")
    out = runner.run()
    report = analyse(out, max_wait=600.0)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted((out / "logs").glob("*.log")))
    detail = f"{summary(report)}\n{logs}"
    assert report["tracebacks"] == 0, detail
    assert not report["hash_agreement"]["disagreements"], detail
    assert report["full_rounds"] == report["outer_steps"], detail
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    begin = next(e["time"] for e in events if e["kind"] == "begin")
    gone = next(e["time"] for e in events if e["kind"] == "kill_bootstrap")
    assert gone - begin >= killed_at - 1, detail
    # Rounds of all three (min group 3) applied after the bootstrap was gone, by each NAT'd worker (the run
    # ends once it has applied ``settle_rounds`` after it; it would have played its whole duration else).
    for name in ("home", "office"):
        after = [r for r in read_metrics(out / "workers" / name / "metrics.jsonl")
                 if r["event"] == "outer_step" and r.get("ok") and r["time"] > gone + 1.0]
        assert len(after) >= 3 and all(r["group_size"] == 3 for r in after), (name, after, detail)
        assert "holds a slot on" in (out / "logs" / f"{name}.log").read_text(errors="replace"), (name, detail)
