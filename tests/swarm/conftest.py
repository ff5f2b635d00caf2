"""Fixtures for multi-process swarm tests on 127.0.0.1.

Every process a test starts is tracked by PID with its descendants (DHT process, p2pd); at the
end it is stopped, and any descendant still alive a few seconds later fails the test as a leak
(after being killed, by PID).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

from opendiloco.testing.proctree import ProcessError, ProcessGroup, end_lingering, spawn_bootstrap

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


class Swarm(ProcessGroup):
    def __init__(self, tmp: Path):
        super().__init__(tmp, cwd=ROOT)
        self.tmp = tmp
        self.peers_file = tmp / "peers.txt"

    def bootstrap(self, timeout: float = 60.0) -> list[str]:
        try:
            return spawn_bootstrap(self, self.peers_file, timeout=timeout)
        except ProcessError as e:
            pytest.fail(str(e))

    def worker(self, name: str, **options):
        args = [sys.executable, str(WORKER), "--peers-file", str(self.peers_file), "--out", str(self.out(name))]
        for key, value in options.items():
            if value is True:  # a flag
                args.append(f"--{key.replace('_', '-')}")
                continue
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

    def wait(self, procs, timeout: float) -> None:
        try:
            super().wait(procs, timeout)
        except ProcessError as e:
            pytest.fail(str(e))

    def wait_for(self, condition, timeout: float, what: str, alive=(), show=()) -> None:
        try:
            super().wait_for(condition, timeout, what, alive, show)
        except ProcessError as e:
            pytest.fail(str(e))


@pytest.fixture(scope="session")
def _lingering():
    """torch's shared-memory managers of the swarm tests' processes, which end 2 s after their last
    client: checked once at the end of the session instead of waited for after every test."""
    pids: set[int] = set()
    yield pids
    stuck = end_lingering(pids)
    assert not stuck, f"shared-memory managers still running at the end of the session (killed now): {stuck}"


@pytest.fixture
def swarm(tmp_path, _lingering):
    s = Swarm(tmp_path)
    yield s
    leaked = s.stop(lingering=_lingering)
    assert not leaked, f"processes left behind by the swarm test (killed now): {leaked}"


@pytest.fixture
def loop():
    """An asyncio loop running in a thread of its own (what a worker's communicator keeps)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
