"""The image, built and trained for real: scripts/container_smoke.sh in a test.

The script builds the image from the Dockerfile (docker, else podman), runs a DHT bootstrap and two
workers from it until they have averaged a few outer steps with equal hashes, checks the image's
HEALTHCHECK and ``opendiloco status`` from a container, stops the workers with SIGTERM (checkpoint,
exit 0, no process left) and removes everything it created.

Slow (``container`` marker): an image build, minutes. It runs where a container engine is usable and
skips, saying why, elsewhere. CI skips it (docs/deployment.md has the figures and the command);
``OPENDILOCO_CONTAINER_SMOKE=1`` runs it there too, ``=0`` skips it anywhere, and
``OPENDILOCO_SMOKE_ARGS`` adds options (e.g. ``--no-build --image opendiloco:latest``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "container_smoke.sh"
ENV_SWITCH = "OPENDILOCO_CONTAINER_SMOKE"


def _answers(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _dockerfile_base() -> str:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG BASE="):
            return line.split("=", 1)[1].strip()
    raise AssertionError("the Dockerfile has no ARG BASE=")


def _smoke_args() -> list[str]:
    """Options for the script on this machine, or pytest.skip with the reason."""
    switch = os.environ.get(ENV_SWITCH, "")
    if switch == "0":
        pytest.skip(f"{ENV_SWITCH}=0")
    if os.environ.get("CI") and switch != "1":
        pytest.skip(f"CI: the container smoke test takes minutes (docs/deployment.md); {ENV_SWITCH}=1 runs it")
    extra = shlex.split(os.environ.get("OPENDILOCO_SMOKE_ARGS", ""))
    if shutil.which("docker") and _answers(["docker", "info"]):
        engine = "docker"
    elif shutil.which("podman"):
        engine = "podman"
    else:
        pytest.skip("no container engine: docker's engine does not answer and podman is not installed")
    if "--no-build" in extra or "--base" in extra or "--make-base" in extra:
        return ["--engine", engine, *extra]
    base = _dockerfile_base()
    if _answers([engine, "image", "inspect", base]):
        return ["--engine", engine, *extra]
    if shutil.which("debootstrap") and os.geteuid() == 0:
        return ["--engine", engine, "--make-base", *extra]
    pytest.skip(f"no base image: {base} is not here ({engine} pull it) and debootstrap as root is not available")


@pytest.mark.container
@pytest.mark.timeout(3600)
def test_image_builds_and_a_swarm_of_containers_trains_and_stops_cleanly(tmp_path):
    args = _smoke_args()
    results = tmp_path / "results.json"
    cmd = ["bash", str(SCRIPT), *args, "--timeout", "1200", "--results", str(results)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3300)
    out = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode == 2:  # an environment the script cannot use (one line says why)
        pytest.skip(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "container_smoke.sh exit 2")
    assert proc.returncode == 0, out
    figures = json.loads(results.read_text())
    print("container smoke figures:", json.dumps(figures))  # shown with pytest -s or -rP
    assert figures["outer_steps_averaged"] >= 3, figures
    assert figures["run_to_first_outer_step_s"] > 0, figures
    assert figures["image_bytes"] > 0, figures
    assert "global_hash agrees" in proc.stdout or "2 live worker(s)" in proc.stdout, out
    assert "exited 0 on SIGTERM" in proc.stdout, out


@pytest.mark.parametrize("bad", [["--outer-steps", "x"], ["--timeout", "0"], ["--frobnicate"], ["--no-build"]])
def test_smoke_script_usage_errors_are_one_line_and_exit_2(bad):
    proc = subprocess.run(["bash", str(SCRIPT), *bad], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("container_smoke.sh: ")


def test_smoke_script_help():
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--make-base" in proc.stdout and "set -euo" not in proc.stdout


# -- join_swarm.sh and a peers file older than its bootstrap (a compose project restarted) ---------

def _fake_opendiloco(tmp_path: Path) -> tuple[dict, Path]:
    """PATH with an `opendiloco` that only records that it was started, and a run secret (as compose gives)."""
    from opendiloco.swarm.membership import new_secret_file

    bin_dir, started = tmp_path / "bin", tmp_path / "started"
    bin_dir.mkdir()
    fake = bin_dir / "opendiloco"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {started}\n")
    fake.chmod(0o755)
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    env = {k: v for k, v in os.environ.items() if k != "OPENDILOCO_RUN_SECRET"}
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OPENDILOCO_RUN_SECRET_FILE": str(secret)}, started


def test_join_swarm_sh_waits_until_a_peer_in_the_file_listens(tmp_path):
    import socket
    import time

    env, started = _fake_opendiloco(tmp_path)
    with socket.socket() as probe:  # a free port, nobody listening yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    addrs = tmp_path / "bootstrap.addrs"
    addrs.write_text(f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL\n")
    proc = subprocess.Popen(["bash", str(SCRIPT.parent / "join_swarm.sh"), "--peers-file", str(addrs), "--wait", "120"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert proc.poll() is None and not started.exists(), "started the trainer before the peer listened"
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()
            proc.wait(timeout=60)
        assert proc.returncode == 0, proc.stderr.read()
        assert f"/tcp/{port}/p2p/" in started.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_join_swarm_sh_gives_up_on_a_peers_file_nobody_answers(tmp_path):
    import socket

    env, started = _fake_opendiloco(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    addrs = tmp_path / "bootstrap.addrs"
    addrs.write_text(f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL\n")
    proc = subprocess.run(["bash", str(SCRIPT.parent / "join_swarm.sh"), "--peers-file", str(addrs), "--wait", "2"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "accepts connections" in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("join_swarm.sh: no peer in") and not started.exists()
