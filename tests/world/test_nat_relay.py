"""Workers behind NAT average together through a relay.

``benchmarks/scenarios/natpair.toml``: two workers behind two different masquerading routers, in
client mode, and the bootstrap as the only public node. Neither worker accepts a connection, so every
stream between them goes through the bootstrap's relay (``opendiloco.swarm.relays``). With a group of
at least 2, a round happens only if they reach each other: both contribute to every round the run
applies, on one θ_global, and both end cleanly. Behaviour only, never timings. The model is tiny on
purpose: a relayed connection carries at most 128 KiB each way (see ``relays.py``).

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


def test_workers_behind_two_nats_average_together_through_the_relay(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    scenario = load_scenario(ROOT / "benchmarks" / "scenarios" / "natpair.toml")
    assert all(w.nat for w in scenario.workers), "every worker of this scenario is behind NAT"
    runner = ScenarioRunner(scenario, tmp_path / "natpair", prefix=f"odnr{os.getpid() % 10000}")
    out = runner.run()
    report = analyse(out, max_wait=600.0)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted((out / "logs").glob("*.log")))
    detail = f"{summary(report)}\n{logs}"

    assert report["tracebacks"] == 0, detail
    assert report["outer_steps"] >= scenario.settle_rounds, detail
    assert not report["hash_agreement"]["disagreements"], detail
    assert report["full_rounds"] == report["outer_steps"], detail  # every applied round held both
    for name, w in report["workers"].items():
        assert w["rounds_in"] == w["rounds_ready"] > 0 and w["contributed_steps"] > 0, (name, detail)
        assert w["exit_codes"] and w["exit_codes"][-1] == 0, (name, detail)
