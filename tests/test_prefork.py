"""The test suite's prefork server: forked children behave as the fresh interpreters they replace.

Its children run a program with the requested arguments, environment, working directory, session
and network namespace, with their output where the caller reads it; whatever it cannot serve the
same way is started as a fresh interpreter instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opendiloco.testing.prefork import ForkedProcess, split_netns
from opendiloco.testing.proctree import ProcessGroup, run_captured

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPORT = ("import os, socket, sys; print(os.getcwd()); print(os.environ.get('PREFORK_PROBE'));"
          "print(sorted(n for _, n in socket.if_nameindex())); print(os.getsid(0) == os.getpid());"
          "print('to stderr', file=sys.stderr); sys.exit(int(sys.argv[1]))")


@pytest.fixture
def server():
    if ProcessGroup.prefork is None:
        pytest.skip("the suite runs without a prefork server (OPENDILOCO_TEST_PREFORK=0)")
    return ProcessGroup.prefork


def test_a_captured_run_is_forked_with_its_args_env_cwd_and_separate_streams(server, tmp_path):
    env = dict(os.environ, PREFORK_PROBE="probe-value")
    args = [sys.executable, "-c", REPORT, "3"]
    assert server.serves(args, env)
    proc = run_captured(args, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 3
    cwd, probe, _, own_session = proc.stdout.splitlines()
    assert (Path(cwd), probe, own_session) == (tmp_path, "probe-value", "False")
    assert proc.stderr == "to stderr\n"


def test_a_captured_run_past_its_timeout_is_killed(server, tmp_path):
    marker = tmp_path / "pid"
    code = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    with pytest.raises(subprocess.TimeoutExpired):
        run_captured([sys.executable, "-c", code], timeout=3, cwd=tmp_path)
    pid = int(marker.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_startup_variable_of_its_own_gets_a_fresh_interpreter(server, tmp_path):
    args = [sys.executable, "-c", "import os; print(os.environ['PYTHONHASHSEED'])"]
    env = dict(os.environ, PYTHONHASHSEED="123")
    assert not server.serves(args, env)
    proc = run_captured(args, timeout=120, cwd=tmp_path, env=env)
    assert (proc.returncode, proc.stdout) == (0, "123\n")


def test_a_program_in_a_network_namespace_is_forked_into_it_in_a_session_of_its_own(server, tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    name = f"odpf{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    try:
        subprocess.run(["ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
                       check=True, timeout=20)
        args = ["ip", "netns", "exec", name, sys.executable, "-c", REPORT, "0"]
        assert split_netns(args) == (name, args[4:])
        assert server.serves(args, dict(os.environ))
        proc = server.spawn(args, tmp_path / "log", tmp_path, dict(os.environ, PREFORK_PROBE="x"), new_session=True)
        assert isinstance(proc, ForkedProcess)
        assert proc.wait(60) == 0, (tmp_path / "log").read_text()
        lines = (tmp_path / "log").read_text().splitlines()
        assert "['lo', 'probe0', 'probe1']" in lines, lines  # the namespace's interfaces, not this host's
        assert "True" in lines, lines  # its own session, as Popen(start_new_session=True)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/run/netns/{name}") and time.monotonic() < deadline:
            time.sleep(0.1)


def test_a_namespace_that_is_not_there_is_not_entered():
    args = ["ip", "netns", "exec", "odpf-no-such-namespace", sys.executable, "-c", "pass"]
    assert split_netns(args) == (None, args)
