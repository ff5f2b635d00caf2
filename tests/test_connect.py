"""``opendiloco.connect``: bad input is refused in one line before anything starts."""

from __future__ import annotations

import pytest

import opendiloco
from opendiloco.errors import SwarmError
from opendiloco.swarm.membership import SECRET_ENV, SECRET_FILE_ENV, new_secret_file

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL"


@pytest.fixture(autouse=True)
def _no_secret_in_the_environment(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


def refused(error, **kwargs) -> str:
    with pytest.raises(error) as raised:
        opendiloco.connect(**kwargs)
    said = str(raised.value)
    assert "\n" not in said and said, said
    return said


def test_without_a_secret_connect_refuses_and_says_how_to_close_or_open_the_run(tmp_path):
    said = refused(SwarmError, initial_peers=[PEER], identity_dir=tmp_path)
    assert "without a run secret" in said and "opendiloco secret FILE" in said and "connect(open=True)" in said
    assert not (tmp_path / "peer.key").exists()  # nothing started


def test_a_secret_and_open_together_are_refused(tmp_path):
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    said = refused(SwarmError, initial_peers=[PEER], identity_dir=tmp_path, secret_file=str(secret), open=True)
    assert "either closed by its secret or open" in said


@pytest.mark.parametrize("peer, words", [
    ("/ip4/127.0.0.1/tcp/31337", "no /p2p/<peer id> part"),
    ("127.0.0.1:31337", "127.0.0.1:31337"),
    ("/ip4/127.0.0.1/tcp/31337/p2p/notapeer", "is not a peer id"),
])
def test_a_bad_peer_address_is_one_line_naming_it(tmp_path, peer, words):
    said = refused(ValueError, initial_peers=peer, identity_dir=tmp_path, open=True)
    assert said.startswith("connect: initial_peers") and words in said, said


@pytest.mark.parametrize("keys, words", [
    ({"compresion": "int8"}, "connect: compresion: unknown key"),
    ({"min_group_size": 0}, "connect: min_group_size: must be >= 1, got 0"),
    ({"weight_by_samples": True}, "DiLoCoOptimizer(weight_by_samples=...)"),
    ({"join_timeout": 5}, "catch_up_timeout"),
    ({"settings": {"f": object()}}, "settings must be JSON values"),
])
def test_swarm_keys_are_checked_as_the_config_checks_them(tmp_path, keys, words):
    said = refused(ValueError, initial_peers=[PEER], identity_dir=tmp_path, open=True, **keys)
    assert words in said, said
