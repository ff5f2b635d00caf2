"""Bad input to ``opendiloco train`` gets one clear line and loses nothing (issue #14's review):
damaged checkpoints, a checkpoint of another model, a full disk, temporary files of a killed run."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opendiloco.testing.proctree import run_captured
from opendiloco.train.checkpoint import CheckpointManager
from opendiloco.train.config import load_config
from opendiloco.train.trainer import train
from tests.test_train_loop import SMALL

ROOT = Path(__file__).resolve().parents[1]


def _config(run_dir: Path, *extra: str):
    return load_config(None, [*SMALL, "--run.dir", str(run_dir), "--checkpoint.keep", "3",
                              "--checkpoint.background", "false", *extra])


def _two_checkpoints(run_dir: Path) -> CheckpointManager:
    """A run of 8 inner steps at H=4: checkpoints at inner steps 4 and 8, ``latest`` names 8."""
    train(_config(run_dir, "--train.total-steps", "8"))
    mgr = CheckpointManager(run_dir)
    assert [p.name for p in mgr.steps()] == ["step-000000004.pt", "step-000000008.pt"]
    return mgr


def _cli(run_dir: Path, *extra: str, preexec_fn=None, timeout: float = 180,
         log_level: str = "INFO") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opendiloco", "--log-level", log_level, "train", *SMALL, "--run.dir", str(run_dir),
           "--checkpoint.keep", "3", "--checkpoint.background", "false", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if preexec_fn is None:
        return run_captured(cmd, timeout=timeout, cwd=ROOT, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, preexec_fn=preexec_fn,
                          env=env)


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # bytes flipped in the middle of the archive
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 4096]) + data[middle + 4096:])


@pytest.mark.parametrize("how", ["empty", "truncated", "corrupt"])
def test_resume_falls_back_from_a_damaged_checkpoint_to_the_previous_intact_one(tmp_path, how):
    run_dir = tmp_path / "run"
    mgr = _two_checkpoints(run_dir)
    newest = mgr.dir / "step-000000008.pt"
    _damage(newest, how)

    resumed = train(_config(run_dir, "--train.total-steps", "12"), resume=True)
    assert resumed.inner_steps == 12 and len(resumed.losses) == 8  # from inner step 4, not from scratch
    assert (mgr.dir / "step-000000008.pt.corrupt").is_file()  # kept for a post-mortem, out of the way
    assert mgr.load()["optimizer"]["inner_steps_total"] == 12

    # The same steps as a run that resumed from step 4 with nothing damaged: bit for bit.
    clean = tmp_path / "clean"
    _two_checkpoints(clean)
    (clean / "checkpoints" / "step-000000008.pt").unlink()
    (clean / "checkpoints" / "latest").unlink()
    assert train(_config(clean, "--train.total-steps", "12"), resume=True).losses == resumed.losses


@pytest.mark.slow
def test_no_intact_checkpoint_is_one_line_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    mgr = _two_checkpoints(run_dir)
    _damage(mgr.dir / "step-000000008.pt", "truncated")
    _damage(mgr.dir / "step-000000004.pt", "empty")
    config_before = (run_dir / "config.toml").read_bytes()
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()

    proc = _cli(run_dir, "--train.total-steps", "16", "--resume", log_level="ERROR")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: no intact checkpoint in {mgr.dir}: step-000000008.pt: ")
    assert "step-000000004.pt: " in lines[0]
    assert (run_dir / "config.toml").read_bytes() == config_before  # not overwritten by the failed resume
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    assert sorted(p.name for p in mgr.steps()) == ["step-000000004.pt", "step-000000008.pt"]  # nothing renamed either


@pytest.mark.slow
def test_a_checkpoint_of_another_model_shape_is_one_line_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    _two_checkpoints(run_dir)
    config_before = (run_dir / "config.toml").read_bytes()
    proc = _cli(run_dir, "--train.total-steps", "16", "--resume", "--model.hidden-size", "64",
                "--model.intermediate-size", "128", log_level="ERROR")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "step-000000008.pt holds a model of another shape (model.hidden_size = 32 there, 64 here; " \
           "model.intermediate_size = 64 there, 128 here)" in lines[0]
    assert (run_dir / "config.toml").read_bytes() == config_before
    assert sorted(p.name for p in CheckpointManager(run_dir).steps()) == ["step-000000004.pt", "step-000000008.pt"]


def test_temporary_files_of_a_killed_write_are_removed_on_start(tmp_path):
    run_dir = tmp_path / "run"
    mgr = _two_checkpoints(run_dir)
    stale = [mgr.dir / ".step-000000012.pt.k2j3h4.tmp", mgr.dir / ".latest.x8y7.tmp", run_dir / ".config.toml.q1.tmp"]
    for p in stale:
        p.write_bytes(b"half a file")
    keep = [mgr.dir / "notes.tmp", run_dir / ".notes"]  # not ours: left alone
    for p in keep:
        p.write_bytes(b"mine")
    train(_config(run_dir, "--train.total-steps", "12"), resume=True)
    assert not any(p.exists() for p in stale)
    assert all(p.read_bytes() == b"mine" for p in keep)


def _file_size_limit(limit: int):
    def apply():  # in the child, before exec: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ is ignored)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_on_disk_is_one_line_and_keeps_the_previous_one(tmp_path):
    """RLIMIT_FSIZE makes every write past 64 KiB fail as a full disk does (EFBIG instead of ENOSPC)."""
    run_dir = tmp_path / "run"
    mgr = _two_checkpoints(run_dir)
    assert (mgr.dir / "step-000000008.pt").stat().st_size > 64 << 10
    proc = _cli(run_dir, "--train.total-steps", "12", "--resume", preexec_fn=_file_size_limit(64 << 10))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: could not write checkpoint {mgr.dir / 'step-000000012.pt'}: File too large"), last
    assert last.endswith("step-000000008.pt stays the latest checkpoint"), last
    assert mgr.latest().name == "step-000000008.pt"
    assert sorted(p.name for p in mgr.dir.iterdir()) == ["latest", "step-000000004.pt", "step-000000008.pt"]
    assert train(_config(run_dir, "--train.total-steps", "12"), resume=True).inner_steps == 12


def _tmpfs_unavailable() -> str | None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return "needs root and unshare(1) to mount a private tmpfs"
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k none /mnt"],
                           capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr.strip()}"


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """A real full disk: a tmpfs of its own (in a private mount namespace, gone when the run ends),
    filled up after the first checkpoints so that the next one cannot be written."""
    reason = _tmpfs_unavailable()
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    python = sys.executable
    train_args = " ".join(["-m", "opendiloco", "train", *SMALL, "--run.dir", str(run_dir), "--checkpoint.keep", "3",
                           "--checkpoint.background", "false"])
    script = f"""
set -u
mount -t tmpfs -o size=4m none {run_dir}
{python} {train_args} --train.total-steps 8 || exit 90
avail=$(df -k --output=avail {run_dir} | tail -1)
dd if=/dev/zero of={run_dir}/filler bs=1k count=$((avail - 48)) 2>/dev/null  # 48 KiB left: not a checkpoint
{python} {train_args} --train.total-steps 12 --resume 2>{tmp_path}/err.txt
echo "rc=$?"
ls -a {run_dir}/checkpoints
cat {run_dir}/checkpoints/latest
rm {run_dir}/filler
{python} -c "import torch; s = torch.load('{run_dir}/checkpoints/step-000000008.pt', weights_only=True); \
print('inner', s['optimizer']['inner_steps_total'])"
"""
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    err = (tmp_path / "err.txt").read_text() if (tmp_path / "err.txt").exists() else proc.stderr
    assert proc.returncode == 0 and "rc=1" in proc.stdout, (proc.stdout, proc.stderr, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: could not write checkpoint {run_dir}/checkpoints/step-000000012.pt: "
                           "No space left on device"), last
    assert last.endswith("step-000000008.pt stays the latest checkpoint"), last
    listing = proc.stdout.split()
    assert "step-000000008.pt" in listing and not any(n.endswith(".tmp") for n in listing), proc.stdout
    assert "step-000000008.pt\ninner 8" in proc.stdout, proc.stdout
    assert not any(run_dir.iterdir())  # the tmpfs went away with its namespace: nothing mounted is left
