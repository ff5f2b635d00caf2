"""Checkpoints are atomic: a crash while writing leaves the previous one intact and loadable."""

import pytest
import torch

from opendiloco.train import checkpoint as ckpt_mod
from opendiloco.train.checkpoint import CheckpointManager, atomic_write


def test_save_load_and_keep_last_k(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    assert mgr.latest() is None and mgr.load() is None
    for step in (4, 8, 12):
        mgr.save({"step": step, "w": torch.full((3,), float(step))}, step)
    assert [p.name for p in mgr.steps()] == ["step-000000008.pt", "step-000000012.pt"]
    state = mgr.load()
    assert state["step"] == 12 and torch.equal(state["w"], torch.full((3,), 12.0))


def test_crash_mid_write_leaves_previous_latest_intact(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep=3)
    mgr.save({"step": 1, "w": torch.ones(4)}, 1)

    def torn_save(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")  # some bytes hit the disk, then the process dies
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod.torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        mgr.save({"step": 2, "w": torch.zeros(4)}, 2)
    monkeypatch.undo()

    assert mgr.latest().name == "step-000000001.pt"
    assert mgr.load()["step"] == 1
    assert sorted(p.name for p in mgr.dir.iterdir()) == ["latest", "step-000000001.pt"]  # no temp files left


def test_interrupt_between_file_and_pointer_keeps_old_pointer(tmp_path, monkeypatch):
    """If the process dies after the new file is complete but before ``latest`` moves, ``latest`` is old."""
    mgr = CheckpointManager(tmp_path, keep=3)
    mgr.save({"step": 1}, 1)
    real = ckpt_mod.atomic_write

    def dies_on_pointer(path, write):
        if path.name == "latest":
            raise KeyboardInterrupt
        real(path, write)

    monkeypatch.setattr(ckpt_mod, "atomic_write", dies_on_pointer)
    with pytest.raises(KeyboardInterrupt):
        mgr.save({"step": 2}, 2)
    monkeypatch.undo()
    assert (mgr.dir / "latest").read_text().strip() == "step-000000001.pt"
    assert mgr.load()["step"] == 1


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "x" / "f.bin"
    atomic_write(target, lambda f: f.write(b"one"))
    atomic_write(target, lambda f: f.write(b"two"))
    assert target.read_bytes() == b"two"
    assert [p.name for p in target.parent.iterdir()] == ["f.bin"]
