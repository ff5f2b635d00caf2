"""Workers behind NAT take full part in rounds with a public worker, whatever the model's size.

``benchmarks/scenarios/natmix.toml``: a public worker and two workers behind two different
masquerading routers, in client mode; every round must hold all three (min group 3). The two
behind NAT accept no connection: what they send each other goes through the bootstrap's relay,
which carries at most 128 KiB per connection each way (``opendiloco.swarm.relays``), and the model
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
