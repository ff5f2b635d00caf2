"""The README's recipes, run as written.

Each recipe is a code block after a ``<!-- recipe: NAME -->`` marker. Its text runs unchanged in
bash, with only what a test on one machine must change:

- the addresses: a "machine" is a folder on 127.0.0.1 with a port of its own, so the documented
  public IPs, ``0.0.0.0`` and port 31337 become 127.0.0.1 and a free port, and the lines marked
  ``yours`` get this run's values (the bootstrap's printed address);
- the length: a shell function named ``opendiloco`` (and ``bash`` for the scripts) adds a few options
  to every ``train`` (a few steps of configs/tiny.toml), and ``scripts/setup.sh`` is not run again
  (CI runs it on a clean clone before the suite; its own checks are in tests/test_install.py).

Every process is started by the ``swarm`` fixture, bounded by a timeout, and stopped by PID.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

from opendiloco.testing.ports import free_port
from opendiloco.testing.proctree import children

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[2]
RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```(\w+)\n(.*?)```", re.S)
BOUND = ("--train.total-steps 6 --optim.local-steps 3 --optim.warmup-steps 2 --train.batch-size 4 "
         "--train.eval-batches 1 --train.threads 1 --run.progress false")
"""What the test adds to every `opendiloco train` of a recipe: configs/tiny.toml, six steps of it."""

def recipes() -> dict[str, tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    return {name: (lang, body) for name, lang, body in RECIPE.findall(text)}


def harness(machine: Path, env_lines: str = "") -> str:
    """What runs before a recipe's text: this machine's folder and the bound on its training."""
    venv_bin = Path(sys.executable).parent
    return f"""set -euo pipefail
export PATH={venv_bin}:$PATH OMP_NUM_THREADS=1
cd {machine}
{env_lines}
opendiloco() {{
    if [ "$1" = train ]; then command opendiloco "$@" {BOUND} $EXTRA_TRAIN; else command opendiloco "$@"; fi
}}
"""


def machine_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "configs").symlink_to(ROOT / "configs")  # the recipes run in a checkout
    return d


def localize(body: str, port: int, **yours: str) -> str:
    """A recipe's text for a "machine" on 127.0.0.1 at ``port``; ``yours``: the lines marked yours."""
    for var, value in yours.items():
        body, n = re.subn(rf"^{var}=\S+", f"{var}={value}", body, flags=re.M)
        assert n == 1, f"the recipe has no line {var}=... to fill in"
    for public in ("203.0.113.5", "198.51.100.7", "0.0.0.0"):
        body = body.replace(public, "127.0.0.1")
    return body.replace("31337", str(port))


def ends(run_root: Path) -> list[dict]:
    """The last record of every worker's metrics.jsonl under ``run_root``."""
    return [json.loads(p.read_text().splitlines()[-1]) for p in sorted(run_root.rglob("metrics.jsonl"))]


def test_the_readme_has_one_recipe_for_each_way_to_run():
    assert set(recipes()) == {"one-machine", "one-worker", "internet-bootstrap", "internet-worker", "own-loop",
                              "compose"}
    body = recipes()["internet-worker"][1]
    for option in ("--swarm.initial-peers", "--swarm.host-maddrs", "--swarm.announce-maddrs", "doctor", "status"):
        assert option in body, f"the internet recipe must show {option}"


@pytest.mark.timeout(400)
def test_one_machine_recipe(swarm, tmp_path):
    lang, body = recipes()["one-machine"]
    assert lang == "bash" and "scripts/setup.sh" in body
    run_dir = tmp_path / "run"
    script = harness(ROOT) + f"""
bash() {{
    case "$1" in
        scripts/setup.sh) echo "setup: run by CI on a clean clone" ;;
        scripts/local_swarm.sh) shift; command bash scripts/local_swarm.sh "$@" --run-dir {run_dir} -- {BOUND} ;;
        *) command bash "$@" ;;
    esac
}}
""" + body
    proc = swarm.spawn(["bash", "-c", script], "one-machine", env={"EXTRA_TRAIN": ""})
    swarm.wait([proc], timeout=300)
    log = swarm.log("one-machine", tail=10**6)
    assert proc.returncode == 0 and "all workers finished" in log, log
    finished = ends(run_dir)
    assert len(finished) == 2 and all(e["event"] == "end" and e["outer_step"] == 2 for e in finished), finished
    assert (run_dir / "run.secret").is_file()


@pytest.mark.timeout(300)
def test_one_worker_recipe(swarm, tmp_path):
    lang, body = recipes()["one-worker"]
    machine = machine_dir(tmp_path, "solo")
    proc = swarm.spawn(["bash", "-c", harness(machine) + body], "one-worker", env={"EXTRA_TRAIN": ""})
    swarm.wait([proc], timeout=240)
    assert proc.returncode == 0, swarm.log("one-worker")
    [end] = ends(machine / "runs")
    assert end["event"] == "end" and end["outer_step"] == 2
    assert (machine / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(400)
def test_two_machines_over_the_internet_recipe(swarm, tmp_path):
    """The bootstrap machine and two worker machines: doctor passes, both train in one run (every
    round with both), status reads the run."""
    boot_body, worker_body = recipes()["internet-bootstrap"][1], recipes()["internet-worker"][1]
    boot = machine_dir(tmp_path, "bootstrap")
    port = free_port()
    bootstrap = swarm.spawn(["bash", "-c", harness(boot) + localize(boot_body, port)], "bootstrap",
                            env={"EXTRA_TRAIN": ""})
    found = re.compile(rf"/ip4/127\.0\.0\.1/tcp/{port}/p2p/\w+")
    swarm.wait_for(lambda: found.search(swarm.log("bootstrap")), 90, "the bootstrap's address", alive=[bootstrap],
                   show=["bootstrap"])
    peer = found.search(swarm.log("bootstrap")).group(0)
    assert (boot / "bootstrap.key").is_file()
    procs = []
    for name in ("eu", "us"):
        machine = machine_dir(tmp_path, name)
        shutil.copy2(boot / "run.secret", machine / "run.secret")  # the recipe's scp
        body = localize(worker_body, free_port(), PEER=peer, PUBLIC_IP="127.0.0.1")
        procs.append(swarm.spawn(["bash", "-c", harness(machine) + body], name,
                                 env={"EXTRA_TRAIN": "--swarm.min-group-size 2 --run.worker " + name}))
    swarm.wait(procs, timeout=300)
    for proc, name in zip(procs, ("eu", "us")):
        log = swarm.log(name, tail=10**6)
        assert proc.returncode == 0, log
        assert "ok   reachable" in log and not re.search(r"^fail ", log, re.M), log  # doctor's findings
        assert "is closed" in log  # a closed run: the secret was read from the copied file
        assert re.search(r"no live workers|global_hash", log), log  # status read the run
    rounds = {}
    for name in ("eu", "us"):
        records = [json.loads(line) for p in (tmp_path / name / "runs").rglob("metrics.jsonl")
                   for line in p.read_text().splitlines()]
        assert records[-1]["event"] == "end" and records[-1]["outer_step"] == 2, records[-1]
        rounds[name] = [r for r in records if r["event"] == "outer_step"]
        assert all(r["ok"] and r["group_size"] == 2 for r in rounds[name]), rounds[name]
    assert [r["global_hash"] for r in rounds["eu"]] == [r["global_hash"] for r in rounds["us"]]
    for pid in children(bootstrap.pid):  # the recipe's dht runs until stopped: as Ctrl-C would, by its PID
        os.kill(pid, signal.SIGINT)
    swarm.wait([bootstrap], timeout=60)


@pytest.mark.timeout(200)
def test_own_loop_recipe_runnable_example(swarm):
    """The recipe names a runnable example of the optimizer in a plain loop: it runs and learns."""
    lang, body = recipes()["own-loop"]
    assert lang == "python" and "DiLoCoOptimizer(" in body
    readme = (ROOT / "README.md").read_text()
    assert "python scripts/example_plain_loop.py --diloco" in readme
    proc = swarm.spawn([sys.executable, "scripts/example_plain_loop.py", "--diloco", "--steps", "40",
                        "--local-steps", "10", "--log-every", "10"], "example")
    swarm.wait([proc], timeout=180)
    assert proc.returncode == 0, swarm.log("example")


# The own-loop recipe runs as written in tests/swarm/test_integrations.py
# (test_the_readmes_own_loop_runs_as_written), as a closed run's worker with its secret.


def test_compose_recipe(tmp_path):
    """Without docker or podman here, what can be checked without them: the secret is made as
    written, and every service the recipe names is one of compose.yaml's."""
    yaml = pytest.importorskip("yaml")
    import subprocess

    lang, body = recipes()["compose"]
    services = set(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"])
    for line in body.splitlines():
        words = line.split()
        if words[:3] == ["docker", "compose", "run"]:
            assert words[-1] in services, line
        elif words[:2] == ["opendiloco", "secret"]:
            proc = subprocess.run([str(Path(sys.executable).parent / "opendiloco"), *words[1:]], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0 and (tmp_path / words[2]).stat().st_mode & 0o077 == 0, proc.stderr
        else:
            assert words[:2] == ["docker", "compose"], line
    if not (shutil.which("docker") or shutil.which("podman")):
        pytest.skip("no docker or podman here: the containers are tested by scripts/container_smoke.sh")
