"""``opendiloco.connect`` gives a loop of one's own a CLI worker's guarantees, on real DHT nodes on 127.0.0.1."""

from __future__ import annotations

import logging
import os
import time

import pytest
from torch import nn

import opendiloco
from opendiloco.errors import SwarmError
from opendiloco.swarm.membership import SECRET_ENV, SECRET_FILE_ENV, new_secret_file
from opendiloco.testing.proctree import descendants, still_running

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def no_leftovers(monkeypatch):
    """No secret from the environment; every DHT process and p2pd the test started is gone at its end."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    before = set(descendants(os.getpid()))
    yield
    left = still_running(set(descendants(os.getpid())) - before)
    assert not left, f"DHT processes or p2pd left running: {left}"


def test_a_closed_worker_keeps_its_identity_and_refuses_other_settings(tmp_path, no_leftovers):
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    model = nn.Linear(4, 2)
    common = dict(secret_file=str(secret), host_maddrs=LOCAL, run_id="mine", settings={"local_steps": 5})
    with opendiloco.connect(identity_dir=tmp_path / "a", model=model, **common) as first:
        assert first.membership.closed
        addrs = (tmp_path / "a" / "peer_addrs.txt").read_text().split()
        assert addrs and all(a.endswith("/p2p/" + first.peer_id) for a in addrs)
        assert (tmp_path / "a" / "peer.key").is_file()
        deadline = time.monotonic() + 30  # its first record is out (published in the background)
        while first.peer_id not in first.presence.records.read_workers(first.presence.max_ttl):
            assert time.monotonic() < deadline, "the first worker's record never appeared"
            time.sleep(0.1)
        # Another model (same run, same secret) is refused at start, in one line naming what differs.
        with pytest.raises(SwarmError) as raised:
            opendiloco.connect(addrs, identity_dir=tmp_path / "b", model=nn.Linear(4, 3), **common)
        said = str(raised.value)
        assert "\n" not in said and "trains with other settings" in said and "connect()" in said, said
        # The same model and settings join.
        with opendiloco.connect(addrs, identity_dir=tmp_path / "c", model=nn.Linear(4, 2), **common) as second:
            assert second.peer_id != first.peer_id
        peer_id = first.peer_id
    # Restarted with its directory, it is the same peer to the run.
    with opendiloco.connect(identity_dir=tmp_path / "a", model=model, **common) as again:
        assert again.peer_id == peer_id


def test_an_open_run_is_a_choice_that_is_said(tmp_path, no_leftovers, caplog):
    with caplog.at_level(logging.WARNING, logger="opendiloco"):
        with opendiloco.connect(identity_dir=tmp_path, open=True, host_maddrs=LOCAL) as comm:
            assert not comm.membership.closed
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("is OPEN" in line and "anyone who can reach" in line for line in said), said


def test_an_unreachable_peer_is_one_line_and_leaves_nothing_running(tmp_path, no_leftovers):
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    gone = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL"
    with pytest.raises(SwarmError) as raised:
        opendiloco.connect([gone], identity_dir=tmp_path, secret_file=str(secret), host_maddrs=LOCAL)
    said = str(raised.value)
    assert "\n" not in said and "could be reached" in said and gone in said, said
