"""The CI scenario: the real CLI in emulated regions with latency, loss, NAT, a crash and a joiner.

``benchmarks/scenarios/ci.toml``: workers a and b in two regions 80 ms apart (0.5% loss,
100 Mbit/s), c behind a NAT in client mode (its router gets a new address after the restart:
its DHT node loses every peer, and used to train alone from then on; its steps must be in a round
after the move, and where it sees the move itself, its record must say so), d joining, a SIGKILLed once
it has written a checkpoint and restarted from it; the run ends once every worker has contributed
to 2 rounds after the last event (at most 150 s). Behaviour only, never timings: nothing crashes, the run
ends on one θ_global (no split lasts), the NAT'd worker and the joiner contribute to rounds, the
killed worker resumes from its checkpoint, and nothing is left behind.

Needs root, iproute2 and iptables (skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from opendiloco.testing.scenario import load_scenario
from opendiloco.testing.scenario_report import analyse, summary
from opendiloco.testing.scenario_runner import ScenarioRunner
from opendiloco.testing.world import unavailable_reason
from opendiloco.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.world, pytest.mark.timeout(600)]


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]


def test_ci_scenario_keeps_the_swarm_correct(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    scenario = load_scenario(ROOT / "benchmarks" / "scenarios" / "ci.toml")
    runner = ScenarioRunner(scenario, tmp_path / "ci", prefix=f"odci{__import__('os').getpid() % 10000}")
    out = runner.run()
    report = analyse(out, max_wait=600.0)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    text = summary(report)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted((out / "logs").glob("*.log")))
    detail = f"{text}\n{logs}"

    assert not _namespaces(runner.prefix), "the scenario left namespaces behind"
    assert report["tracebacks"] == 0, detail
    assert report["outer_steps"] > 0, detail
    # No split lasts: whatever forked (a worker that restarted or joined while the others went on)
    # was healed, and the run ends on one θ_global. Every fork is in the report.
    assert report["hash_agreement"]["last_steps_agree"], detail
    w = report["workers"]
    # The NAT'd worker and the joiner took part in rounds, with their work counted.
    for name in ("c", "d"):
        assert w[name]["rounds_in"] > 0 and w[name]["contributed_steps"] > 0, detail
    # The NAT'd worker went on taking part after its router's new address: its own steps are in a round
    # it applied after the move. How it learnt of the move varies with the load: a sign (its connection
    # to its relay broke, or its DHT node lost every peer at once), a round that failed fast and was
    # retried, or a round's silence (cut off). Where it saw a sign, its record said so and a peer read it.
    moved_at = next(r["time"] for r in _events(out) if r["kind"] == "readdress" and r["worker"] == "c")
    after_move = [r for r in read_metrics(out / "workers" / "c" / "metrics.jsonl")
                  if r.get("event") == "outer_step" and r.get("ok") and (r.get("contributed_steps") or 0) > 0
                  and r.get("time", 0.0) > moved_at]
    assert after_move, detail
    by_name = {p.stem: p.read_text(errors="replace") for p in (out / "logs").glob("*.log")}
    if "its router's address changed" in by_name["c"]:
        c_id = re.search(r"worker (\w+) joined", by_name["c"]).group(1)[-8:]
        assert any(re.search(rf"the address of [^(]*{c_id}[^(]*changed", text)
                   for name, text in by_name.items() if name != "c"), detail
    # The killed worker came back from its checkpoint and contributed again after it.
    assert w["a"]["launches"] == 2, detail
    assert w["a"]["resumed"][-1] is True, detail
    assert w["a"]["launch_to_first_contribution_s"][-1] is not None, detail
    # Every worker's last instance left cleanly when the run ended (SIGTERM: checkpoint and exit 0).
    for p in w.values():
        assert p["exit_codes"] and p["exit_codes"][-1] == 0, detail
