"""Checkpoints written atomically: a crash at any moment leaves the previous one loadable.

Layout in ``<run_dir>/checkpoints/``: ``step-<inner step>.pt`` files and ``latest``, a small
text file naming the newest one. Both are written to a temporary file in the same
directory, fsynced, then renamed over the target (``os.replace`` is atomic on POSIX), so
``latest`` always names a complete file.

``save_in_background`` takes a snapshot of the state (the only part the training loop waits
for: a copy to host memory) and writes it on a thread. One write runs at a time: the next save
waits for it. A failed write is logged and counted; the previous checkpoint stays ``latest``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LATEST = "latest"
_NAME = re.compile(r"^step-(\d+)\.pt$")


def atomic_write(path: Path, write) -> None:
    """Calls ``write(fileobj)`` on a temporary file, then moves it to ``path`` in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600 files; checkpoints are ordinary files
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def snapshot(obj, pool: list[torch.Tensor] | None = None):
    """A copy of a nested state (dicts, lists, tuples, tensors, plain values) whose tensors are
    contiguous CPU tensors of its own, so training can go on changing the originals.

    ``pool``: the tensors of the previous snapshot, in the same order. Each is reused where shape
    and dtype match (no allocation, no page faults: the copy runs at memory speed), and the list
    is updated to this snapshot's tensors.
    """
    pool = [] if pool is None else pool
    counter = [0]

    def copy(t: torch.Tensor) -> torch.Tensor:
        i = counter[0]
        counter[0] += 1
        t = t.detach()
        if i < len(pool) and pool[i].shape == t.shape and pool[i].dtype == t.dtype:
            return pool[i].copy_(t)
        fresh = torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)
        if i < len(pool):
            pool[i] = fresh
        else:
            pool.append(fresh)
        return fresh

    def walk(o):
        if isinstance(o, torch.Tensor):
            return copy(o)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(walk(v) for v in o)
        return o

    out = walk(obj)
    del pool[counter[0]:]
    return out


class CheckpointManager:
    def __init__(self, run_dir: Path, keep: int = 3):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self.last_write: dict | None = None
        """The last completed write: path, bytes, write seconds."""
        self.failed_writes = 0
        self._pool: list[torch.Tensor] = []
        """The last snapshot's tensors, reused by the next one (host memory: one checkpoint's size)."""

    def save_in_background(self, state: dict, step: int) -> float:
        """Snapshots ``state`` and writes it on a thread; returns the seconds the caller was held
        (waiting for the previous write, if it still runs, and the snapshot)."""
        began = time.perf_counter()
        self.wait()  # the previous write is done with the pool
        frozen = snapshot(state, self._pool)
        self._writer = self._writer or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending = self._writer.submit(self._write, frozen, step)
        return time.perf_counter() - began

    def wait(self) -> BaseException | None:
        """Blocks until the write in progress (if any) is done; returns (and logs) what made it fail.

        A failed write loses that checkpoint only: the previous one stays ``latest``, training goes on.
        """
        pending, self._pending = self._pending, None
        error = pending.exception() if pending is not None else None
        if error is not None:
            self.failed_writes += 1
            log.error("writing a checkpoint failed (the previous one stays latest): %s: %s",
                      type(error).__name__, error)
        return error

    def close(self) -> None:
        self.wait()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self._pool.clear()

    def _write(self, state: dict, step: int) -> Path:
        began = time.perf_counter()
        path = self.save(state, step)
        self.last_write = {"path": str(path), "bytes": path.stat().st_size, "write_s": time.perf_counter() - began}
        log.debug("checkpoint %s written in %.1f s", path.name, self.last_write["write_s"])
        return path

    def save(self, state: dict, step: int) -> Path:
        path = self.dir / f"step-{step:09d}.pt"
        atomic_write(path, lambda f: torch.save(state, f))
        atomic_write(self.dir / LATEST, lambda f: f.write(path.name.encode() + b"\n"))
        self._prune(keep_also=path)
        return path

    def steps(self) -> list[Path]:
        """Checkpoint files, oldest written first. Not by step number: a worker that adopts a peer's
        state can move back a few inner steps, and its newest checkpoint must stay the one kept."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            if m := _NAME.match(p.name):
                try:
                    found.append((p.stat().st_mtime_ns, int(m.group(1)), p))
                except FileNotFoundError:  # pruned meanwhile
                    continue
        return [p for _, _, p in sorted(found)]

    def latest(self) -> Path | None:
        pointer = self.dir / LATEST
        if pointer.is_file():
            path = self.dir / pointer.read_text().strip()
            if path.is_file():
                return path
        found = self.steps()  # no pointer (e.g. copied by hand): the newest complete file
        return found[-1] if found else None

    def load(self, path: Path | None = None, map_location="cpu") -> dict | None:
        path = path or self.latest()
        if path is None:
            return None
        # weights_only: a checkpoint holds tensors and plain values, never arbitrary objects.
        return torch.load(path, map_location=map_location, weights_only=True)

    def _prune(self, keep_also: Path) -> None:
        files = self.steps()
        for old in files[: max(0, len(files) - self.keep)]:
            if old != keep_also:
                old.unlink(missing_ok=True)
