"""The container health check, and the deployment files that use it (Dockerfile, compose.yaml).

There is no Docker engine in CI: what the image runs is tested here, outside the image.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opendiloco.swarm.ops import health

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the check itself ----------------------------------------------------------------------------

def test_listening_port_is_healthy_and_a_closed_one_is_not(listener):
    assert health.port_listening(listener)
    ok, reason = health.check(listener)
    assert ok and str(listener) in reason
    port = closed_port()
    ok, reason = health.check(port)
    assert not ok and f"port {port}" in reason and reason.startswith("unhealthy")


def test_reads_ipv4_and_ipv6_socket_tables(tmp_path):
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    tcp = tmp_path / "tcp"
    tcp.write_text(header
                   + "   0: 00000000:7A69 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000 0 1\n"
                   + "   1: 0100007F:1F90 0100007F:A000 01 00000000:00000000 00:00000000 00000000  1000 0 2\n")
    tcp6 = tmp_path / "tcp6"
    tcp6.write_text(header + "   0: 00000000000000000000000000000000:0050 "
                    "00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 3\n")
    tables = [str(tcp), str(tcp6), str(tmp_path / "missing")]
    assert health._listening_ports(tables) == {31337, 80}
    assert health.port_listening(31337, tables)
    assert health.port_listening(80, tables)
    assert not health.port_listening(8080, tables)  # established, not listening


def test_falls_back_to_connecting_without_proc_tables(listener, tmp_path):
    nowhere = [str(tmp_path / "tcp"), str(tmp_path / "tcp6")]
    assert health._listening_ports(nowhere) is None
    assert health.port_listening(listener, nowhere)
    assert not health.port_listening(closed_port(), nowhere)


def test_heartbeat_file_must_be_fresh(tmp_path):
    beat = tmp_path / "metrics.jsonl"
    ok, reason = health.check(None, str(beat), max_age=60)
    assert not ok and "does not exist" in reason
    beat.write_text("{}\n")
    assert health.check(None, str(beat), max_age=60)[0]
    old = time.time() - 120
    os.utime(beat, (old, old))
    ok, reason = health.check(None, str(beat), max_age=60)
    assert not ok and "more than 60s" in reason


def test_main_exit_status_and_env_port(listener, monkeypatch, capsys):
    monkeypatch.setenv(health.PORT_ENV, str(listener))
    assert health.main([]) == 0
    assert "ok:" in capsys.readouterr().out
    monkeypatch.setenv(health.PORT_ENV, str(closed_port()))
    assert health.main([]) == 1
    assert "unhealthy" in capsys.readouterr().err
    assert health.main(["--port", str(listener)]) == 0
    assert health.main(["--port", "70000"]) == 1
    monkeypatch.delenv(health.PORT_ENV)
    assert health.main(["--no-port", "--file", str(ROOT / "pyproject.toml"), "--max-age", "1e12"]) == 0


def test_module_runs_as_the_image_runs_it(listener):
    """The HEALTHCHECK command, as a process: `python -m opendiloco.swarm.ops.health`."""
    env = dict(os.environ, **{health.PORT_ENV: str(listener)})
    proc = subprocess.run([sys.executable, "-m", "opendiloco.swarm.ops.health"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    env[health.PORT_ENV] = str(closed_port())
    proc = subprocess.run([sys.executable, "-m", "opendiloco.swarm.ops.health"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "unhealthy" in proc.stderr


# -- Dockerfile ------------------------------------------------------------------------------------

def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_runs_the_cli_the_health_check_and_exposes_the_default_port():
    text = dockerfile()
    assert 'ENTRYPOINT ["opendiloco"]' in text
    healthcheck = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])$", text, re.M | re.S)
    assert healthcheck and "opendiloco.swarm.ops.health" in healthcheck.group(1)
    assert re.search(rf"^EXPOSE {health.DEFAULT_PORT}/tcp", text, re.M)
    assert f"OPENDILOCO_P2P_PORT={health.DEFAULT_PORT}" in text
    assert re.search(r"^USER (?!0|root)", text, re.M), "the image must not run as root"


def test_dockerfile_copies_only_what_exists():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for line in dockerfile().splitlines():
        if line.startswith("COPY") and "--from" not in line:
            sources = shlex.split(line)[1:-1]
            for src in sources:
                matches = [p for p in ROOT.glob(src)]
                assert matches or src.endswith("*"), f"COPY {src}: not in the repository"
                for m in matches:
                    assert m.relative_to(ROOT).parts[0] not in ignored, f"COPY {src}: excluded by .dockerignore"
    assert os.access(ROOT / "scripts/join_swarm.sh", os.X_OK)


def test_dockerfile_lints_clean_with_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (scripts/lint_docker.sh installs it)")
    proc = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- compose.yaml ---------------------------------------------------------------------------------

def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def option(args: list[str], name: str) -> list[str]:
    """Values of `name` in an argument list (up to the next --option)."""
    i = args.index(name) + 1
    values = []
    while i < len(args) and not args[i].startswith("--"):
        values.append(args[i])
        i += 1
    return values


def test_compose_workers_join_the_bootstrap_by_service_name():
    from opendiloco.swarm.daemon.node import parse_maddrs
    from opendiloco.train.config import SwarmConfig

    spec = compose()
    services = spec["services"]
    assert {"bootstrap", "worker"} <= set(services)
    boot, worker = services["bootstrap"], services["worker"]
    boot_cmd = boot["command"]
    assert boot_cmd[0] == "dht"
    port = health.DEFAULT_PORT
    assert option(boot_cmd, "--swarm.host-maddrs") == [f"/ip4/0.0.0.0/tcp/{port}"]
    announced = option(boot_cmd, "--swarm.announce-maddrs")
    assert f"/dns4/bootstrap/tcp/{port}" in announced

    # The identity is on a volume of its own, so the peer id (and the address) survive restarts.
    identity = option(boot_cmd, "--swarm.identity-path")[0]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in boot["volumes"]}
    assert os.path.dirname(identity) in mounts and mounts[os.path.dirname(identity)] in spec["volumes"]

    # Workers read the address the bootstrap writes, from the same volume.
    addrs_file = option(boot_cmd, "--addrs-file")[0]
    assert option(worker["command"], "--peers-file") == [addrs_file]
    boot_vol = mounts[os.path.dirname(addrs_file)]
    worker_mounts = {v.split(":")[1]: v.split(":")[0] for v in worker["volumes"]}
    assert worker_mounts[os.path.dirname(addrs_file)] == boot_vol
    assert worker["entrypoint"] == ["join_swarm.sh"]
    assert "ports" not in worker, "scaled workers cannot share one host port"

    # What the workers will be given is a valid initial peer for the library and the config.
    example = f"/dns4/bootstrap/tcp/{port}/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL"
    assert parse_maddrs([example], what="initial peer", require_peer_id=True) == [example]
    assert SwarmConfig(initial_peers=[example]).enabled

    for svc in (boot, worker):
        assert "opendiloco.swarm.ops.health" in " ".join(svc["healthcheck"]["test"])


def test_compose_runs_are_closed_by_a_secret_every_worker_and_status_read():
    """The workers and `status` get the run secret as a compose secret (a file the user makes with
    `opendiloco secret`); the bootstrap needs none (it stores signed records it cannot read)."""
    spec = compose()
    services = spec["services"]
    [name] = spec["secrets"]
    assert spec["secrets"][name]["file"] == "${OPENDILOCO_RUN_SECRET_FILE:-./run.secret}"
    mounted = f"/run/secrets/{name}"  # where compose mounts a secret given by its name
    worker, status = services["worker"], services["status"]
    assert worker["secrets"] == [name] and option(worker["command"], "--secret-file") == [mounted]
    assert status["secrets"] == [name] and f"status --swarm.secret-file {mounted} " in status["command"][0]
    assert "secrets" not in services["bootstrap"]
    assert "--open-run" not in worker["command"]
    assert "*.secret" in (ROOT / ".gitignore").read_text().split()
    assert "**/*.secret" in (ROOT / ".dockerignore").read_text().split()  # never in a build context


def test_compose_worker_command_is_what_join_swarm_sh_accepts(tmp_path):
    """Runs the worker's entry script with the compose arguments (dry run) against a fake address file
    and a secret where compose would mount it."""
    from opendiloco.swarm.membership import new_secret_file

    worker = compose()["services"]["worker"]
    args = [re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", a) for a in worker["command"]]
    addrs = tmp_path / "bootstrap.addrs"
    addrs.write_text("/dns4/bootstrap/tcp/31337/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL\n")
    secret = tmp_path / "run_secret"
    new_secret_file(str(secret))
    args[args.index("--peers-file") + 1] = str(addrs)
    args[args.index("--config") + 1] = str(ROOT / "configs/tiny.toml")
    args[args.index("--secret-file") + 1] = str(secret)
    proc = subprocess.run(["bash", str(ROOT / "scripts/join_swarm.sh"), "--dry-run", *args],
                          capture_output=True, text=True, timeout=30, env=_no_secret_env())
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[1] == "train"
    assert option(cmd, "--swarm.initial-peers") == [addrs.read_text().strip()]
    assert option(cmd, "--swarm.host-maddrs") == [f"/ip4/0.0.0.0/tcp/{health.DEFAULT_PORT}"]
    assert option(cmd, "--swarm.secret-file") == [str(secret)] and "--swarm.open" not in cmd
    assert "--resume" in cmd


def _no_secret_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENDILOCO_RUN_SECRET", "OPENDILOCO_RUN_SECRET_FILE")}
    return {**env, **extra}


def test_join_swarm_sh_needs_a_secret_or_an_open_run(tmp_path):
    """Closed by default: without a secret (option, environment or config) it refuses before any wait,
    in one line; --open-run is the explicit choice of an open run."""
    from opendiloco.swarm.membership import new_secret_file

    script, peer = str(ROOT / "scripts/join_swarm.sh"), "/ip4/1.2.3.4/tcp/1/p2p/X"
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))

    def dry_run(*args, **env):
        return subprocess.run(["bash", script, "--dry-run", *args], capture_output=True, text=True, timeout=60,
                              env=_no_secret_env(**env))

    proc = dry_run("--peers-file", str(tmp_path / "never-written"), "--wait", "600")  # refused before the wait
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("join_swarm.sh: no run secret: give the run's secret file with --secret-file FILE")
    for said in ("opendiloco secret FILE", "--open-run", "vote on the run's state", "stall rounds"):
        assert said in proc.stderr, said
    for args, env, message in [
            (["--open-run", "--secret-file", str(secret)], {}, "a run is either open or closed"),
            (["--open-run"], {"OPENDILOCO_RUN_SECRET_FILE": str(secret)}, "$OPENDILOCO_RUN_SECRET_FILE is set"),
            (["--secret-file", str(tmp_path / "missing")], {}, "missing or not readable"),
            ([], {"OPENDILOCO_RUN_SECRET_FILE": str(tmp_path / "missing")}, "missing or not readable")]:
        proc = dry_run(peer, *args, **env)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, \
            (args, proc.stderr)

    def command(*args, **env):
        proc = dry_run(peer, *args, **env)  # options after the peer, and `-- train options` last
        assert proc.returncode == 0, proc.stderr
        return shlex.split(proc.stdout)

    cmd = command("--open-run")
    assert "--swarm.open" in cmd and "--swarm.secret-file" not in cmd
    cmd = command("--secret-file", str(secret))
    assert option(cmd, "--swarm.secret-file") == [str(secret)] and "--swarm.open" not in cmd
    for env in ({"OPENDILOCO_RUN_SECRET_FILE": str(secret)}, {"OPENDILOCO_RUN_SECRET": "x" * 32}):
        cmd = command(**env)  # the trainer reads the same variable
        assert "--swarm.open" not in cmd and "--swarm.secret-file" not in cmd
    config = tmp_path / "closed.toml"
    config.write_text(f"[swarm]\nsecret_file = {str(secret)!r}\n")
    assert "--swarm.open" not in command("--config", str(config))
    assert command("--", "--swarm.open")[-1] == "--swarm.open"


def test_local_swarm_sh_refuses_an_open_run_with_a_secret_before_starting_anything(tmp_path):
    """The main job is closed by default (tests/swarm/test_train_cli.py runs it); a contradiction between
    --open-run and a secret, or a secret it cannot read, is one line and nothing is made."""
    script, run_dir = str(ROOT / "scripts/local_swarm.sh"), tmp_path / "run"
    secret = tmp_path / "run.secret"
    secret.write_text("0" * 64 + "\n")
    for args, env, message in [
            (["--open-run", "--secret-file", str(secret)], {}, "a run is either open or closed"),
            (["--open-run"], {"OPENDILOCO_RUN_SECRET": "x" * 32}, "$OPENDILOCO_RUN_SECRET is set"),
            (["--secret-file", str(tmp_path / "missing")], {}, "is not a readable file"),
            ([], {"OPENDILOCO_RUN_SECRET_FILE": str(tmp_path / "missing")}, "is not a readable file")]:
        proc = subprocess.run(["bash", script, "--run-dir", str(run_dir), *args], capture_output=True, text=True,
                              timeout=60, env=_no_secret_env(**env))
        assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("local_swarm.sh: ") and message in proc.stderr, (args, proc.stderr)
        assert not run_dir.exists()


def test_join_swarm_sh_refuses_bad_input():
    script = str(ROOT / "scripts/join_swarm.sh")
    for args, message in [([], "at least one peer"),
                          (["/ip4/198.51.100.1/tcp/31337"], "/p2p/"),
                          (["--port", "x", "/ip4/1.2.3.4/tcp/1/p2p/X"], "--port"),
                          (["--public-ip", "203.0.113.7", "/ip4/1.2.3.4/tcp/1/p2p/X"], "fixed --port")]:
        proc = subprocess.run(["bash", script, "--dry-run", "--open-run", *args], capture_output=True, text=True,
                              timeout=30, env=_no_secret_env())
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
    proc = subprocess.run(["bash", script, "--dry-run", "--open-run", "--port", "31337", "--public-ip", "203.0.113.7",
                           "--client-mode", "/ip4/1.2.3.4/tcp/1/p2p/X"], capture_output=True, text=True, timeout=30,
                          env=_no_secret_env())
    cmd = shlex.split(proc.stdout)
    assert option(cmd, "--swarm.announce-maddrs") == ["/ip4/203.0.113.7/tcp/31337"]
    assert "--swarm.client-mode" in cmd


@pytest.mark.parametrize("script", ["join_swarm.sh", "local_swarm.sh", "lint_docker.sh"])
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
