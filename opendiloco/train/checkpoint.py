"""Checkpoints written atomically: a crash at any moment leaves the previous one loadable.

Layout in ``<run_dir>/checkpoints/``: ``step-<inner step>.pt`` files and ``latest``, a small
text file naming the newest one. Both are written to a temporary file in the same
directory, fsynced, then renamed over the target (``os.replace`` is atomic on POSIX), so
``latest`` always names a complete file.

``save_in_background`` takes a snapshot of the state (the only part the training loop waits
for: a copy to host memory) and writes it on a thread. One write runs at a time: the next save
waits for it. A failed write is logged and counted; the previous checkpoint stays ``latest``.

A write that fails (a full disk, a quota) raises ``CheckpointError``, one line naming the file and
the cause; its temporary file is removed. Temporary files left by a killed process are removed
by ``remove_stale_temp_files`` when a worker starts. ``load_intact`` skips a checkpoint that cannot
be read (truncated, empty, corrupt), sets it aside as ``<name>.corrupt``, and falls back to the
previous one.

What a checkpoint holds, and how it is made from and loaded into a trainer: ``checkpoint_format.py``.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from .checkpoint_format import REQUIRED_KEYS

log = logging.getLogger(__name__)

LATEST = "latest"
_NAME = re.compile(r"^step-(\d+)\.pt$")
_TEMP = re.compile(r"^\..+\.tmp$")
"""``atomic_write``'s temporary files: ``.<target name>.<random>.tmp``."""


class CheckpointError(OSError):
    """A checkpoint could not be written or read (an OSError: disk, quota, damaged file); ``str()`` is one
    line for the user."""


def _root_cause(error: BaseException) -> BaseException:
    """The innermost OSError of an exception chain (torch wraps a failed write in its own errors)."""
    seen, todo, found = set(), [error], error
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            found = e
        todo += [e.__cause__, e.__context__]
    return found


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return (text[0][:200] if text else "") or type(error).__name__


def describe_write_error(path: Path, error: BaseException) -> str:
    """One line: which file, why, and how much room is left where it was written."""
    cause = _root_cause(error)
    why = _one_line(cause)
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        try:
            st = os.statvfs(path.parent)
            why += f" ({st.f_bavail * st.f_frsize / 2**20:.1f} MiB free in {path.parent})"
        except OSError:
            pass
    return f"could not write checkpoint {path}: {why}"


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
        """Writes ``state`` as the checkpoint of ``step`` and makes it ``latest``; raises
        ``CheckpointError`` (the previous checkpoint stays ``latest``) if that fails."""
        path = self.dir / f"step-{step:09d}.pt"
        previous = self.latest()
        try:
            atomic_write(path, lambda f: torch.save(state, f))
            atomic_write(self.dir / LATEST, lambda f: f.write(path.name.encode() + b"\n"))
        except Exception as e:
            log.debug("writing %s failed", path, exc_info=True)
            kept = f"; {previous.name} stays the latest checkpoint" if previous and previous != path else ""
            raise CheckpointError(describe_write_error(path, e) + kept) from None
        self._prune(keep_also=path)
        return path

    def remove_stale_temp_files(self) -> list[Path]:
        """Removes the temporary files of writes that never finished (a killed or crashed process).
        Call only while holding the run dir: a live writer's temporary file looks the same."""
        removed = []
        for folder in (self.dir, self.dir.parent):
            if not folder.is_dir():
                continue
            for p in folder.iterdir():
                if _TEMP.match(p.name) and p.is_file():
                    p.unlink(missing_ok=True)
                    removed.append(p)
        if removed:
            log.info("removed %d unfinished temporary file(s): %s", len(removed), ", ".join(p.name for p in removed))
        return removed

    def candidates(self) -> list[Path]:
        """Checkpoint files to resume from, best first: the one ``latest`` names, then newest written first."""
        found = list(reversed(self.steps()))
        pointer = self.latest()
        if pointer is not None and pointer in found:
            found.remove(pointer)
            found.insert(0, pointer)
        return found

    def load_intact(self, map_location="cpu") -> tuple[Path, dict] | None:
        """The newest checkpoint that can be read whole, as (path, state); None if there is none at all.

        The previous one is tried when a file cannot be read. Once an intact one is found, the newer
        damaged ones (empty, truncated, corrupt, not a checkpoint) are renamed to ``<name>.corrupt``:
        kept for a post-mortem, out of the way of the next resume and of pruning. Raises
        ``CheckpointError`` if there were checkpoints but none is intact (then nothing is renamed).
        """
        problems, damaged = [], []
        for path in self.candidates():
            try:
                state = torch.load(path, map_location=map_location, weights_only=True)
                if not isinstance(state, dict) or not all(k in state for k in REQUIRED_KEYS):
                    raise ValueError("not a checkpoint of this trainer (fields missing)")
            except OSError as e:  # unreadable now (permissions, I/O): not proven damaged, left in place
                problems.append(f"{path.name}: {_one_line(e)}")
                log.warning("cannot read checkpoint %s (%s)", path, _one_line(e))
                continue
            except Exception as e:  # truncated, empty or corrupt: torch raises several types
                problems.append(f"{path.name}: {_one_line(e)}")
                damaged.append(path)
                log.warning("checkpoint %s is damaged (%s)", path, _one_line(e))
                continue
            for bad in damaged:
                try:
                    os.replace(bad, bad.with_name(bad.name + ".corrupt"))
                except OSError as e:
                    log.warning("could not set %s aside: %s", bad, _one_line(e))
            if problems:
                log.warning("resuming from %s, the newest intact checkpoint (damaged ones renamed to *.corrupt)",
                            path.name)
            return path, state
        if problems:
            raise CheckpointError(f"no intact checkpoint in {self.dir}: " + "; ".join(problems))
        return None

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
