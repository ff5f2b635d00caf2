"""Processes and their descendants, read from /proc; a group of started processes stopped by PID.

A swarm worker starts a DHT process, which starts ``p2pd``: stopping a worker cleanly means
finding those too. Everything here acts on PIDs this program started (or their descendants),
never on processes found by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from opendiloco.testing.prefork import DUMP_SIGNAL, ForkedProcess, PreforkServer


def children_table() -> dict[int, list[int]]:
    """parent PID -> child PIDs, for every process visible now."""
    table: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                table.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass  # exited while we looked
    return table


def children(pid: int) -> list[int]:
    return children_table().get(pid, [])


def descendants(pid: int, table: dict[int, list[int]] | None = None) -> list[int]:
    table = children_table() if table is None else table
    out, todo = [], [pid]
    while todo:
        for child in table.get(todo.pop(), []):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def describe(pid: int) -> str:
    """One line on a process: state, kernel wait channel, threads, command line."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "-"
    except OSError:
        return f"{pid}: gone"
    cmd = command_line(pid)
    return f"{pid}: state {fields[0]}, waiting in {wchan}, {fields[17]} thread(s): {cmd[:160]}"


def alive(pid: int) -> bool:
    """True for a running process (a zombie is not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def command_name(pid: int) -> str:
    """The kernel's name for a process (``/proc/PID/comm``, at most 15 characters); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces; "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


ONCE_PER_PROCESS = ("torch_shm_manager", "resource_tracker")
"""Long-lived helpers that torch and multiprocessing start once per process, not once per node."""


def still_running(started: set[int], timeout: float = 10.0) -> dict[int, str]:
    """Of the processes in ``started`` (PIDs of descendants of this process), those still running after up
    to ``timeout`` seconds, with their command lines; the once-per-process helpers do not count."""
    pids = {p for p in started if not any(helper in command_line(p) for helper in ONCE_PER_PROCESS)}
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {p: command_line(p) for p in pids if alive(p)}


SELF_ENDING = ("torch_shm_manag",)
"""Helpers that end on their own a few seconds after their last client: torch's shared-memory manager
(hivemind shares memory through it) waits 2 s for a new client before it cleans up and exits."""


def end_lingering(pids: set[int], timeout: float = 10.0) -> list[int]:
    """Waits for the ``pids`` handed over by ``ProcessGroup.stop`` to end; kills and returns those that
    did not end within ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    stuck = sorted(p for p in pids if alive(p) and command_name(p) in SELF_ENDING)
    for pid in stuck:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return stuck


class ProcessError(RuntimeError):
    """A process of the group failed or did not finish in time (the message ends with its log)."""


class ProcessGroup:
    """Processes started for one job, each logging to ``<log_dir>/<name>.log``.

    ``stop()`` ends them (SIGTERM, then SIGKILL), waits for every descendant seen along the way
    to exit, kills the ones that do not, and returns their PIDs: a non-empty list is a leak.
    """

    def __init__(self, log_dir: Path, cwd: Path | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        self.procs: list[subprocess.Popen] = []
        self.known: set[int] = set()

    prefork: PreforkServer | None = None
    """Set (by the test suite) to start Python programs by forking a pre-imported interpreter."""

    def spawn(self, args: Sequence[str], name: str, env: dict | None = None) -> subprocess.Popen:
        path = self.log_dir / f"{name}.log"
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        proc = None
        if self.prefork is not None:
            proc = self.prefork.spawn(args, path, self.cwd or Path.cwd(), full_env)
        if proc is None:
            with open(path, "ab") as log:
                proc = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                        env=full_env)
        proc.name = name
        self.procs.append(proc)
        return proc

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def diagnose(self, proc) -> str:
        """What a process that seems stuck is doing: its tree's states, and (for a forked child)
        every thread's Python stack, which it writes to its log on ``DUMP_SIGNAL``."""
        lines = [describe(pid) for pid in [proc.pid, *descendants(proc.pid)]]
        if isinstance(proc, ForkedProcess) and proc.poll() is None:
            before = len(self.log(proc.name, 1_000_000))
            proc.send_signal(DUMP_SIGNAL)
            time.sleep(1.0)
            lines.append(self.log(proc.name, 1_000_000)[before:][-6000:] or "(no stack dump)")
        return "\n".join(lines)

    def track(self, table: dict[int, list[int]] | None = None) -> set[int]:
        """Remembers the descendants of the running processes; returns the PIDs alive now."""
        table = children_table() if table is None else table
        pids = set()
        for proc in list(self.procs):
            if proc.poll() is None:
                pids.add(proc.pid)
                pids.update(descendants(proc.pid, table))
        self.known |= pids - {p.pid for p in self.procs}
        return pids

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> None:
        """Waits for ``procs`` to exit with status 0 (within ``timeout`` in all)."""
        deadline = time.monotonic() + timeout
        for proc in procs:
            self.track()
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ProcessError(f"{proc.name} did not finish within {timeout:.0f}s:\n{self.log(proc.name)}") \
                    from None
            if proc.returncode != 0:
                raise ProcessError(f"{proc.name} exited with {proc.returncode}:\n{self.log(proc.name)}")

    def wait_for(self, condition: Callable[[], object], timeout: float, what: str,
                 alive: Sequence[subprocess.Popen] = (), show: Sequence[str] = ()) -> None:
        """Polls ``condition`` until it holds. Raises ``ProcessError`` (with the logs of ``alive`` and
        of the processes named in ``show``) if a process of ``alive`` exits first, or after
        ``timeout`` seconds: state what must happen relative to the run, with a generous bound."""
        deadline = time.monotonic() + timeout
        while not condition():
            for proc in alive:
                if proc.poll() is not None:
                    raise ProcessError(f"{proc.name} exited ({proc.returncode}) while waiting for {what}:\n"
                                       f"{self.log(proc.name)}")
            if time.monotonic() > deadline:
                names = [p.name for p in alive] + [n for n in show if n not in {p.name for p in alive}]
                logs = "\n".join(f"--- {n}\n{self.log(n)}" for n in names)
                states = "\n".join(f"--- {p.name}, now:\n{self.diagnose(p)}" for p in alive if p.poll() is None)
                raise ProcessError(f"no {what} within {timeout:.0f}s\n{logs}\n{states}")
            time.sleep(0.1)

    def stop(self, grace: float = 10.0, lingering: set[int] | None = None) -> list[int]:
        """Ends the group's processes; returns the PIDs of descendants that outlived them (leaks).

        With ``lingering``, helpers that end on their own shortly after their last client
        (``SELF_ENDING``) are added to it instead of waited for: whoever owns the set checks later
        that they did end (``end_lingering``)."""
        self.track()
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if lingering is not None:
            helpers = {p for p in self.known if alive(p) and command_name(p) in SELF_ENDING}
            lingering |= helpers
            self.known -= helpers
        deadline = time.monotonic() + 8
        while any(alive(p) for p in self.known) and time.monotonic() < deadline:
            time.sleep(0.2)
        leaked = sorted(p for p in self.known if alive(p))
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leaked


def run_captured(args: Sequence[str], *, timeout: float, cwd: Path | None = None,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, ...)``, forked from the prefork server
    where it can serve ``args`` (a Python program, also inside a network namespace) and started as
    a fresh interpreter otherwise. Keep a fresh interpreter where what a user sees at start matters
    (warnings printed by imports)."""
    import tempfile

    server = ProcessGroup.prefork
    full_env = dict(os.environ if env is None else env)
    if server is not None and server.serves(args, full_env):
        with tempfile.TemporaryDirectory(prefix="captured-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            proc = server.spawn(args, out, cwd or Path.cwd(), full_env, err=err)
            if proc is not None:
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
                    raise subprocess.TimeoutExpired(list(args), timeout, out.read_text(errors="replace"),
                                                    err.read_text(errors="replace")) from None
                return subprocess.CompletedProcess(list(args), proc.returncode, out.read_text(errors="replace"),
                                                   err.read_text(errors="replace"))
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)


def spawn_bootstrap(group: ProcessGroup, addrs_file: Path, name: str = "bootstrap",
                    timeout: float = 60.0) -> list[str]:
    """Starts an ``opendiloco`` bootstrap DHT node on 127.0.0.1 in ``group``; returns its addresses.

    A forked bootstrap that does not come up within ``timeout`` is stopped, reported (a warning
    with its threads' stacks) and started again as a fresh interpreter, and the prefork server
    serves no more processes: whatever went wrong in it must not fail every later test."""
    import sys
    import warnings

    Path(addrs_file).unlink(missing_ok=True)  # a stale file would name a bootstrap that is gone
    code = ("import sys; from opendiloco.swarm.daemon.bootstrap import run_bootstrap; "
            f"sys.exit(run_bootstrap(host_maddrs=['/ip4/127.0.0.1/tcp/0'], addrs_file={str(addrs_file)!r}))")
    proc = group.spawn([sys.executable, "-c", code], name)
    deadline = time.monotonic() + timeout
    while not Path(addrs_file).exists():
        if proc.poll() is not None:
            raise ProcessError(f"bootstrap exited ({proc.returncode}):\n{group.log(name)}")
        if time.monotonic() > deadline:
            stuck = f"bootstrap did not write its addresses within {timeout:.0f}s:\n{group.log(name)}\n" \
                    f"{group.diagnose(proc)}"
            if not isinstance(proc, ForkedProcess) or group.prefork is None:
                raise ProcessError(stuck)
            warnings.warn(f"prefork: a forked {stuck}\nstarting it as a fresh interpreter; no more forks", stacklevel=2)
            group.prefork.failed = True
            proc.kill()
            proc.wait(10)
            return spawn_bootstrap(group, addrs_file, name, timeout)
        time.sleep(0.1)
    return Path(addrs_file).read_text().split()
