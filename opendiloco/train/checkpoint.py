"""Checkpoints written atomically: a crash at any moment leaves the previous one loadable.

Layout in ``<run_dir>/checkpoints/``: ``step-<inner step>.pt`` files and ``latest``, a small
text file naming the newest one. Both are written to a temporary file in the same
directory, fsynced, then renamed over the target (``os.replace`` is atomic on POSIX), so
``latest`` always names a complete file.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch

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


class CheckpointManager:
    def __init__(self, run_dir: Path, keep: int = 3):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, state: dict, step: int) -> Path:
        path = self.dir / f"step-{step:09d}.pt"
        atomic_write(path, lambda f: torch.save(state, f))
        atomic_write(self.dir / LATEST, lambda f: f.write(path.name.encode() + b"\n"))
        self._prune(keep_also=path)
        return path

    def steps(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

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
