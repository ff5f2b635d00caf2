"""Fixtures for multi-process swarm tests on 127.0.0.1.

Every process a test starts is tracked by PID with its descendants (DHT process, p2pd); at the
end it is stopped, and any descendant still alive a few seconds later fails the test as a leak
(after being killed, by PID).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Swarm:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.known_descendants: set[int] = set()
        self.peers_file = tmp / "peers.txt"

    def spawn(self, args: list[str], name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        proc.name = name
        self.procs.append(proc)
        return proc

    def bootstrap(self, timeout: float = 60.0) -> list[str]:
        code = ("import sys; from opendiloco.swarm.bootstrap import run_bootstrap; "
                f"sys.exit(run_bootstrap(host_maddrs=['/ip4/127.0.0.1/tcp/0'], addrs_file={str(self.peers_file)!r}))")
        proc = self.spawn([sys.executable, "-c", code], "bootstrap")
        deadline = time.monotonic() + timeout
        while not self.peers_file.exists():
            assert proc.poll() is None, f"bootstrap exited: {self.log('bootstrap')}"
            assert time.monotonic() < deadline, "bootstrap did not write its addresses in time"
            time.sleep(0.1)
        return self.peers_file.read_text().split()

    def worker(self, name: str, **options) -> subprocess.Popen:
        args = [sys.executable, str(WORKER), "--peers-file", str(self.peers_file), "--out", str(self.out(name))]
        for key, value in options.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            args += [f"--{key.replace('_', '-')}", *map(str, values)]
        return self.spawn(args, name)

    def out(self, name: str) -> Path:
        return self.tmp / f"{name}.jsonl"

    def records(self, name: str, event: str = "sync") -> list[dict]:
        path = self.out(name)
        if not path.exists():
            return []
        return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def wait(self, procs, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in procs:
            self.track(proc)
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{proc.name} did not finish within {timeout}s:\n{self.log(proc.name)}")
            assert proc.returncode == 0, f"{proc.name} exited with {proc.returncode}:\n{self.log(proc.name)}"

    def track(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            self.known_descendants |= descendants(proc.pid)

    def cleanup(self) -> list[int]:
        for proc in self.procs:
            self.track(proc)
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        deadline = time.monotonic() + 8
        while any(alive(p) for p in self.known_descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        leaked = sorted(p for p in self.known_descendants if alive(p))
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leaked


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    yield s
    leaked = s.cleanup()
    assert not leaked, f"processes left behind by the swarm test (killed now): {leaked}"
