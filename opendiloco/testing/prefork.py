"""Starting Python processes by forking one that has already imported torch and hivemind.

A swarm test starts several worker processes, and each fresh interpreter spends about 2.4 s of CPU
importing torch, hivemind and this package before it does anything; over the suite that was half
of all the CPU it used. A *prefork server* pays that once: it imports the heavy modules, then, for
each request, forks a child that runs the requested program (``python -m mod``, ``python -c
code`` or ``python script.py``) with the requested arguments, environment, working directory and
log file. The server reaps its children and writes each exit status to a file, so the caller's
handle (:class:`ForkedProcess`) answers ``poll``/``wait``/``terminate`` as ``subprocess.Popen``
does, by PID. A program run inside a network namespace (``ip netns exec NAME python ...``, the
emulated hosts of ``netns.py`` and ``world.py``) is forked too: the child enters the namespace
(``setns``) before it runs anything, which is all ``ip netns exec`` does that a worker needs (its
p2p daemon, started later, inherits the namespace).

Forking is only safe from a process with one thread: the server checks that before every fork
and stops serving (callers fall back to ``subprocess.Popen``) if an import ever started one. A
request whose environment differs from the server's in what an interpreter reads only at start
(``LD_PRELOAD``, ``PYTHON*``, ``HIVEMIND_*``, thread counts, ...) is not served either.

This is test machinery: a user's processes start the ordinary way.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PRELOAD = ("torch", "hivemind", "opendiloco.swarm.communicator", "opendiloco.swarm.daemon.bootstrap",
           "opendiloco.train.trainer", "opendiloco.cli")
"""What the server imports once, for all its children."""

STARTUP_ENV = ("LD_", "PYTHON", "HIVEMIND_", "OMP_", "MKL_", "TORCH_", "CUDA_", "FAKETIME", "MALLOC_")
"""Environment variables read when an interpreter or a preloaded library starts: a request that
sets any of them otherwise than the server's environment gets a fresh interpreter instead."""

DUMP_SIGNAL = signal.SIGUSR1
"""Makes a forked child write every thread's Python stack to its log (``ProcessGroup.diagnose``)."""

REQUEST_MAX = 1 << 20
START_TIMEOUT = 120.0
NETNS_EXEC = ("ip", "netns", "exec")
NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000


# -- the server ---------------------------------------------------------------------------------
def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _enter_netns(name: str) -> None:
    """Moves this (single-threaded) process into the named network namespace, as ``ip netns exec``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run_child(request: dict) -> None:
    """In the forked child: becomes the requested program. Never returns to the server's loop: the
    program's end (or its ``SystemExit``) ends the interpreter the ordinary way (atexit handlers,
    multiprocessing children, non-daemon threads)."""
    import random

    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if request.get("err") else log
    if request.get("session"):
        os.setsid()
    if request.get("netns"):
        try:
            _enter_netns(request["netns"])
        except OSError as e:
            os.write(err, f"prefork: {e}\n".encode())  # where the caller reads the child's errors
            os._exit(126)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(err, 2)
    os.close(log)
    if err != log:
        os.close(err)
    os.close(null)
    os.chdir(request["cwd"])
    import faulthandler

    faulthandler.register(DUMP_SIGNAL, all_threads=True)  # a hung child's stacks, on request, in its log
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh interpreter seeds from the OS; forked children must not share a sequence
    try:
        import numpy

        numpy.random.seed()
    except ImportError:
        pass
    kind, target, args = request["kind"], request["target"], request["args"]
    import runpy
    import types

    if kind == "-m":
        sys.argv = [target, *args]
        sys.path[0] = request["cwd"]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "-c":
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:  # a script's path
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    sys.exit(0)


def _warm() -> None:
    """What every worker would otherwise import on first use, once for all: an optimizer's first
    step imports ``torch._dynamo`` and hundreds of modules behind it (about 1.2 s of CPU); on a model
    too small for any thread pool."""
    import torch

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 2)).sum().backward()
    optimizer.step()


def settle() -> None:
    """Makes this process a good one to fork workers from: imports :data:`PRELOAD`, warms up, and
    freezes what that made. Every child would otherwise scan (and, writing each object's GC header,
    copy page by page) all of it in its own collections and in the full collection at its exit:
    seconds of CPU per child. Frozen objects are left out of every collection."""
    for name in PRELOAD:
        __import__(name)
    _warm()
    gc.collect()
    gc.freeze()


def serve(sock_path: str, status_dir: str) -> None:
    """The server's loop: one request per connection (JSON), answered with the child's PID."""
    settle()
    if _threads() != 1:
        print(f"prefork: importing started {_threads() - 1} thread(s); not serving", file=sys.stderr)
        sys.exit(3)
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(16)
    Path(sock_path + ".ready").write_text(str(os.getpid()))
    while os.getppid() == parent:  # the caller is gone: so is the server (its children stay tracked by PID)
        ready, _, _ = select.select([server], [], [], 0.05)
        _reap(status_dir)
        if not ready:
            continue
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            request = json.loads(_read_all(conn))
            if _threads() != 1:
                conn.sendall(b"0")
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _run_child(request)
            conn.sendall(str(pid).encode())


def _reap(status_dir: str) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tmp = os.path.join(status_dir, f"{pid}.tmp")
        with open(tmp, "w") as f:
            f.write(str(_exit_code(status)))
        os.replace(tmp, os.path.join(status_dir, str(pid)))


def _read_all(conn: socket.socket) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > REQUEST_MAX:
            raise ValueError("prefork request too large")
        chunks.append(chunk)


# -- the caller's side --------------------------------------------------------------------------
def split_netns(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(namespace, program)`` of ``ip netns exec NAME program...``; ``(None, args)`` otherwise."""
    args = list(args)
    if tuple(args[:3]) == NETNS_EXEC and len(args) > 4 and os.path.exists(os.path.join(NETNS_DIR, args[3])):
        return args[3], args[4:]
    return None, args


class ForkedProcess:
    """A child of the prefork server, driven like ``subprocess.Popen`` (by PID; its exit status is
    the one the server wrote when it reaped it)."""

    def __init__(self, pid: int, args: Sequence[str], status_dir: Path):
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._status = status_dir / str(pid)

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped, so the PID is still this process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreforkServer:
    """The caller's handle on one prefork server (started on first use, stopped by ``close``)."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.status_dir = self.workdir / "status"
        self.sock_path = str(self.workdir / "prefork.sock")
        self.proc: subprocess.Popen | None = None
        self.failed = False
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def _start(self) -> bool:
        self.status_dir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "prefork.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, self.sock_path, str(self.status_dir)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(self.sock_path + ".ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.failed = True
                self.close()
                return False
            time.sleep(0.05)
        return True

    def serves(self, args: Sequence[str], env: dict) -> bool:
        _, args = split_netns(args)
        if self.failed or len(args) < 2 or args[0] != sys.executable:
            return False
        if args[1] in ("-m", "-c"):
            if len(args) < 3:
                return False
        elif args[1].startswith("-") or not args[1].endswith(".py"):
            return False
        keys = {k for k in set(env) | set(self.env) if k.startswith(STARTUP_ENV)}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def spawn(self, args: Sequence[str], log: Path, cwd: Path, env: dict, new_session: bool = False,
              err: Path | None = None) -> ForkedProcess | None:
        """The started child, or None if this server cannot start it (the caller starts it itself).
        ``new_session``: the child leads a session of its own (``Popen(start_new_session=True)``);
        ``err``: its standard error goes there instead of to ``log``."""
        if not self.serves(args, env) or (self.proc is None and not self._start()):
            return None
        netns, program = split_netns(args)
        if program[1] in ("-m", "-c"):
            kind, target, rest = program[1], program[2], program[3:]
        else:
            kind, target, rest = "script", program[1], program[2:]
        request = {"kind": kind, "target": target, "args": list(rest), "log": str(log), "cwd": str(cwd),
                   "env": env, "netns": netns, "session": new_session, "err": str(err) if err else None}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            try:
                conn.connect(self.sock_path)
                conn.sendall(json.dumps(request).encode())
                conn.shutdown(socket.SHUT_WR)
                pid = int(conn.recv(64) or b"0")
            except (OSError, ValueError):
                pid = 0
        if pid <= 0:
            self.failed = True
            return None
        return ForkedProcess(pid, args, self.status_dir)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
