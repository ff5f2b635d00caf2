"""Bad input around the swarm gets one clear line, and loses nothing (issue #14's review): an
unreachable peer, a port in use, workers with other settings, a state download that stalls or whose
donor dies. The bad donor lives in the test suite (bad_donor.py), not in the library."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from opendiloco.testing.ports import free_port
from opendiloco.train.checkpoint import CheckpointManager
from opendiloco.train.config import config_fingerprint, load_config
from opendiloco.train.trainer import train
from tests.test_train_loop import SMALL

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

A_PEER_ID = "12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL"
LOCAL = ["--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0"]


def _train(swarm, name: str, run_dir: Path, *extra: str):
    """A CLI worker of an open run (on purpose: these tests are about peers, not membership)."""
    return swarm.spawn([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(run_dir),
                        "--run.worker", name, *LOCAL, "--swarm.open", *extra], name)


def _finish(swarm, proc, timeout: float) -> tuple[int, list[str]]:
    proc.wait(timeout)
    return proc.returncode, swarm.log(proc.name, tail=20000).strip().splitlines()


def test_train_with_an_unreachable_peer_is_one_line(swarm, tmp_path):
    peer = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{A_PEER_ID}"  # a well-formed address nobody listens on
    proc = _train(swarm, "lonely", tmp_path / "run", "--swarm.initial-peers", peer)
    code, lines = _finish(swarm, proc, 120)
    assert code == 2, lines
    assert not any("Traceback" in line for line in lines), lines
    assert lines[-1].startswith("opendiloco train: none of the initial peers could be reached"), lines[-1]
    assert peer in lines[-1]
    # An open run, chosen with --swarm.open: said at start, with what it allows.
    [warning] = [line for line in lines if "is OPEN" in line]
    assert "WARNING" in warning and "vote on the run's state" in warning and "stall its rounds" in warning, warning


def test_dht_on_a_port_in_use_refuses_in_one_line(swarm):
    addrs = swarm.bootstrap()
    port = addrs[0].split("/tcp/")[1].split("/")[0]
    proc = swarm.spawn([sys.executable, "-m", "opendiloco", "dht", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
                       "second-dht")
    code, lines = _finish(swarm, proc, 60)
    assert code == 2, lines
    assert lines == [f"opendiloco dht: port {port} is already in use on 127.0.0.1 (another `opendiloco dht` or "
                     f"worker?): stop it, or listen on another port (/ip4/127.0.0.1/tcp/{port})"], lines
    # The same check for a worker that asks for a fixed port, on all interfaces.
    proc = _train(swarm, "taken", swarm.tmp / "taken", "--swarm.initial-peers", *addrs,
                  "--swarm.host-maddrs", f"/ip4/0.0.0.0/tcp/{port}")
    code, lines = _finish(swarm, proc, 120)
    assert code == 2 and lines[-1].startswith(f"opendiloco train: port {port} is already in use"), lines


def test_workers_with_other_settings_are_refused_in_one_line(swarm, tmp_path):
    """Same parameter shapes (32 wide with 4 or 2 heads), or another H: averaging them would be silent
    nonsense, so a newcomer with other settings is refused at start, and the run goes on."""
    peers = swarm.bootstrap()
    first = _train(swarm, "first", tmp_path / "first", "--swarm.initial-peers", *peers, "--train.total-steps", "100000",
                   "--train.throttle", "0.05", "--swarm.join-timeout", "1")
    metrics = tmp_path / "first" / "metrics.jsonl"
    swarm.wait_for(lambda: metrics.is_file() and '"event": "start"' in metrics.read_text(), 120,
                   "start of the first worker", [first])
    theirs = config_fingerprint(load_config(None, SMALL))
    for name, other in (("heads", ["--model.num-heads", "2"]), ("local-steps", ["--optim.local-steps", "8"])):
        second = _train(swarm, name, tmp_path / name, "--swarm.initial-peers", *peers, *other)
        code, lines = _finish(swarm, second, 120)
        assert code == 2, lines
        assert not any("Traceback" in line for line in lines), lines
        mine = config_fingerprint(load_config(None, [*SMALL, *other]))
        expected = (f"opendiloco train: worker {first_peer(tmp_path / 'first')} of run 'opendiloco' trains with "
                    f"other settings (config fingerprint {theirs}, this worker's {mine})")
        assert lines[-1].startswith(expected), lines[-1]
        assert not (tmp_path / name / "checkpoints").exists()
    assert first.poll() is None  # the run goes on

    # One record with other settings beside a worker with ours refuses only its writer: a newcomer
    # with the run's settings starts (before, every newcomer exited 2 on that one record).
    marker = _bad_donor(swarm, tmp_path, "stall", ["--model.num-heads", "2"], outer_step=0)
    fake = Path(f"{marker}.up").read_text()[-8:]
    newcomer = _train(swarm, "newcomer", tmp_path / "newcomer", "--swarm.initial-peers", *peers,
                      "--train.total-steps", "100000", "--train.throttle", "0.05")
    started = tmp_path / "newcomer" / "metrics.jsonl"
    swarm.wait_for(lambda: started.is_file() and '"event": "start"' in started.read_text(), 120,
                   "start of the newcomer", [newcomer])
    warned = [line for line in swarm.log("newcomer", tail=10**6).splitlines() if "has other settings" in line]
    assert warned and all(fake in line for line in warned), warned
    for proc in (newcomer, first):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, swarm.log(proc.name)


def first_peer(run_dir: Path) -> str:
    """The last 8 characters of the peer id a CLI worker printed in its peer_addrs.txt."""
    return (run_dir / "peer_addrs.txt").read_text().split()[0].rsplit("/p2p/", 1)[1][-8:]


def _resumable_run(run_dir: Path) -> Path:
    """A run dir with checkpoints at inner steps 4 and 8 (outer step 2); returns the latest's path."""
    train(load_config(None, [*SMALL, "--run.dir", str(run_dir), "--train.total-steps", "8"]))
    return CheckpointManager(run_dir).latest()


def _bad_donor(swarm, tmp_path: Path, mode: str, config_args: list[str], outer_step: int = 5):
    marker = tmp_path / f"donor-{mode}"
    fingerprint = config_fingerprint(load_config(None, [*SMALL, *config_args]))
    swarm.spawn([sys.executable, "-m", "tests.swarm.bad_donor", "--peers-file", str(swarm.peers_file), "--mode", mode,
                 "--marker", str(marker), "--config", fingerprint, "--outer-step", str(outer_step)], f"donor-{mode}")
    swarm.wait_for(lambda: Path(f"{marker}.up").exists(), 90, "bad donor")
    return marker


def test_ctrl_c_during_a_state_download_stops_at_once_and_keeps_the_checkpoint(swarm, tmp_path):
    swarm.bootstrap()
    run_dir = tmp_path / "run"
    latest = _resumable_run(run_dir)
    before = latest.read_bytes()
    marker = _bad_donor(swarm, tmp_path, "stall", [])
    proc = _train(swarm, "joiner", run_dir, "--resume", "--train.total-steps", "100",
                  "--swarm.initial-peers", *swarm.peers_file.read_text().split(), "--swarm.join-timeout", "600")
    swarm.wait_for(lambda: marker.exists(), 120, "state request", [proc])
    time.sleep(1.0)  # well inside the download
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)  # once, as a user would
    code, lines = _finish(swarm, proc, 90)
    took = time.monotonic() - sent
    assert code == 0, lines
    assert took < 60, f"took {took:.0f}s to stop"  # not the join timeout (600 s)
    assert lines[-1] == "stopped at inner step 8; continue with --resume", lines
    assert CheckpointManager(run_dir).latest() == latest and latest.read_bytes() == before
    state = torch.load(latest, weights_only=True)
    assert state["optimizer"]["inner_steps_total"] == 8


def test_a_donor_dying_mid_download_honours_on_join_failure_exit(swarm, tmp_path):
    swarm.bootstrap()
    marker = _bad_donor(swarm, tmp_path, "die", [])
    run_dir = tmp_path / "joiner"
    proc = _train(swarm, "joiner", run_dir, "--train.total-steps", "100", "--swarm.on-join-failure", "exit",
                  "--swarm.join-timeout", "90", "--swarm.initial-peers", *swarm.peers_file.read_text().split())
    code, lines = _finish(swarm, proc, 150)
    assert marker.exists()  # the download began
    assert code == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    assert lines[-1].startswith("error: could not download state from the swarm: "), lines[-1]
    assert not (run_dir / "checkpoints").exists()  # it did not start training from fresh weights


def test_ctrl_c_during_a_catch_up_download_stops_at_once_and_writes_the_checkpoint(swarm, tmp_path):
    """The review's case: a training worker finds the run ahead of it, starts downloading state from
    a peer that is slow to serve it, and the user presses Ctrl-C once."""
    peers = swarm.bootstrap()
    run_dir = tmp_path / "run"
    proc = _train(swarm, "worker", run_dir, "--train.total-steps", "100000", "--train.throttle", "0.2",
                  "--swarm.join-timeout", "1", "--swarm.initial-peers", *peers)
    metrics = run_dir / "metrics.jsonl"
    swarm.wait_for(lambda: metrics.is_file() and '"event": "outer_step"' in metrics.read_text(), 120,
                   "first outer step", [proc])
    # It says it is far ahead, whatever step the worker (alone until then, so fast) has reached.
    marker = _bad_donor(swarm, tmp_path, "stall", [], outer_step=1_000_000)
    swarm.wait_for(lambda: marker.exists(), 120, "state request", [proc])
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, lines = _finish(swarm, proc, 90)
    took = time.monotonic() - sent
    assert code == 0, lines
    assert took < 45, f"took {took:.0f}s to stop"  # the catch-up would have waited 60 s
    assert lines[-1].startswith("stopped at inner step ") and lines[-1].endswith("; continue with --resume"), lines
    stopped_at = int(lines[-1].split()[4].rstrip(";"))
    latest = CheckpointManager(run_dir).latest()
    assert latest is not None and latest.name == f"step-{stopped_at:09d}.pt"
    assert torch.load(latest, weights_only=True)["optimizer"]["inner_steps_total"] == stopped_at


def test_workers_with_other_settings_that_start_together_never_average_together(swarm):
    """No worker refused the other at start (the library does not check at start; two CLI workers
    starting at the same moment may not see each other yet): the fingerprint still keeps them apart,
    like two runs. b0 is live and waiting for a partner the whole time the pair trains."""
    swarm.bootstrap()
    odd = swarm.worker("b0", seed=2, local_steps=4, min_group_size=2, matchmaking_timeout=10,
                       run_until_stopped=True, config_fingerprint="bbbb")
    swarm.wait_for(lambda: swarm.records("b0", "start"), 120, "start of b0", [odd])
    pair = [swarm.worker(name, seed=i, outer_steps=2, local_steps=4, min_group_size=2, straggler_wait=30,
                         config_fingerprint="aaaa") for i, name in enumerate(("a0", "a1"))]
    swarm.wait(pair, timeout=180)
    assert odd.poll() is None, swarm.log("b0")
    odd.send_signal(signal.SIGTERM)
    swarm.wait([odd], timeout=90)
    peers = {name: swarm.records(name, "start")[0]["peer_id"] for name in ("a0", "a1", "b0")}
    for name in ("a0", "a1"):
        syncs = swarm.records(name)
        assert [s["outer_step"] for s in syncs if s["ok"]] == [1, 2], syncs
        assert all(set(s["peers"]) == {peers["a0"], peers["a1"]} for s in syncs if s["ok"]), (name, syncs)
    assert not any(s["ok"] for s in swarm.records("b0")), swarm.records("b0")
