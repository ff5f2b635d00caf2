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


def test_background_write_stores_the_state_as_it_was_when_saved(tmp_path):
    import threading

    mgr = CheckpointManager(tmp_path, keep=2)
    w = torch.arange(1000, dtype=torch.float32)
    release = threading.Event()
    real_save = ckpt_mod.torch.save

    def slow_save(obj, f):  # the write starts only after training has changed the tensors
        release.wait(30)
        real_save(obj, f)

    ckpt_mod.torch.save = slow_save
    try:
        blocked = mgr.save_in_background({"step": 5, "w": w, "nested": [{"v": w[:3]}]}, 5)
        w.mul_(-1)  # training goes on in place
        release.set()
        assert mgr.wait() is None
    finally:
        ckpt_mod.torch.save = real_save
    assert blocked >= 0
    state = mgr.load()
    assert torch.equal(state["w"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(state["nested"][0]["v"], torch.arange(3, dtype=torch.float32))
    assert mgr.last_write["bytes"] == mgr.latest().stat().st_size
    mgr.close()


def test_a_failed_background_write_is_reported_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep=3)
    mgr.save({"step": 1}, 1)

    def disk_full(obj, f):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod.torch, "save", disk_full)
    mgr.save_in_background({"step": 2}, 2)
    error = mgr.wait()
    monkeypatch.undo()
    assert isinstance(error, OSError) and mgr.failed_writes == 1
    assert mgr.load()["step"] == 1
    mgr.save_in_background({"step": 3}, 3)  # the next one is written as usual
    mgr.close()
    assert mgr.load()["step"] == 3


def test_snapshots_reuse_the_previous_snapshots_memory_and_copy_faithfully():
    from opendiloco.train.checkpoint import snapshot

    pool = []
    a = {"w": torch.arange(6.0), "l": [torch.ones(2, 2), 3], "t": (torch.zeros(1, dtype=torch.int64),)}
    first = snapshot(a, pool)
    assert len(pool) == 3 and first["w"] is pool[0] and first["w"].data_ptr() != a["w"].data_ptr()
    a["w"].add_(1)
    second = snapshot(a, pool)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # reused
    assert torch.equal(second["w"], torch.arange(6.0) + 1) and second["l"][1] == 3
    assert isinstance(second["t"], tuple) and second["t"][0].dtype == torch.int64
    third = snapshot({"w": torch.ones(3)}, pool)  # another shape: fresh memory, and the pool shrinks
    assert len(pool) == 1 and torch.equal(third["w"], torch.ones(3))


def test_negative_and_positive_zero_are_not_the_same_weights():
    """θ_global is stored once only where its bytes equal the weights': its fingerprint hashes bytes."""
    from opendiloco.train.checkpoint_format import same_bits

    assert same_bits(torch.tensor([0.0, 1.5]), torch.tensor([0.0, 1.5]))
    assert not same_bits(torch.tensor([0.0, 1.5]), torch.tensor([-0.0, 1.5]))
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # why torch.equal is not enough


def test_the_newest_checkpoint_is_kept_even_at_a_lower_step(tmp_path):
    """A worker that adopted a peer's state may write step 95 after step 100: 95 is the newest."""
    import os
    import time

    mgr = CheckpointManager(tmp_path, keep=1)
    first = mgr.save({"step": 100}, 100)
    past = time.time() - 60
    os.utime(first, (past, past))  # written a minute ago (file times may be coarser than two quick saves)
    mgr.save({"step": 95}, 95)
    assert [p.name for p in mgr.steps()] == ["step-000000095.pt"]  # by step number, 100 would survive
    (mgr.dir / "latest").unlink()
    assert mgr.load()["step"] == 95  # without the pointer too
