"""hivemind's p2p daemon, unpacked into this project's cache (``opendiloco/swarm/daemon/p2pd_binary.py``, run by setup).

hivemind's installed files stay exactly as pip recorded them. The unpacked copy must be the very
program the packed one runs: the same bytes every time it is made, answering as the packed one does,
and a daemon that the project's DHT nodes start and peers reach.
"""

from __future__ import annotations

import base64
import hashlib
import os
from importlib import metadata
from pathlib import Path

import pytest

from opendiloco.swarm.daemon.p2pd_binary import (
    PACKED_SUFFIX,
    UnpackError,
    _usage,
    cached_path,
    daemon_path,
    file_hash,
    install,
    is_packed,
    main,
    recorded_hash,
    restore_installed,
    unpack,
    use_unpacked,
)

pytestmark = pytest.mark.timeout(120)


def test_hivemind_installed_files_are_the_ones_pip_recorded():
    """Nothing of this project rewrites another package's files: every file in hivemind's RECORD has
    the recorded hash, and no file sits beside its daemon that pip did not put there."""
    dist = metadata.distribution("hivemind")
    checked, wrong = 0, []
    for entry in dist.files or []:
        if entry.hash is None or entry.hash.mode != "sha256":
            continue
        path = Path(entry.locate())
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        checked += 1
        if digest != entry.hash.value:
            wrong.append(str(entry))
    assert checked > 100 and not wrong, f"hivemind's files differ from pip's record: {wrong}"
    recorded = {Path(e.locate()).name for e in dist.files if "hivemind_cli/" in e.as_posix()}
    beside = {p.name for p in daemon_path().parent.iterdir() if p.is_file()}
    assert beside <= recorded, f"files pip did not install beside hivemind's daemon: {beside - recorded}"


def _packed_daemon() -> Path:
    packed = daemon_path()
    if not is_packed(packed):
        pytest.skip("no UPX-packed p2pd here (hivemind's wheel ships one for x86-64 Linux)")
    return packed


def test_the_unpacked_daemon_is_the_same_program_and_leaves_the_packed_one_as_it_was(tmp_path):
    packed = _packed_daemon()
    before = file_hash(packed)
    try:
        line = unpack(packed, tmp_path / "a" / "p2pd")
    except UnpackError as e:
        pytest.skip(f"cannot unpack here: {e}")
    assert "unpacked into" in line
    unpack(packed, tmp_path / "b")
    copy = tmp_path / "a" / "p2pd"
    assert not is_packed(copy) and copy.read_bytes() == (tmp_path / "b").read_bytes()  # made the same way
    assert _usage(copy) == _usage(packed)
    assert file_hash(packed) == before == recorded_hash()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["p2pd"]  # no temporary file left
    cached = cached_path()
    if cached is not None and cached.exists():  # the one setup made: the same bytes
        assert cached.read_bytes() == copy.read_bytes()


def test_the_cache_is_named_for_the_daemon_pip_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENDILOCO_CACHE_DIR", str(tmp_path))
    recorded = recorded_hash()
    if recorded is None:
        pytest.skip("hivemind has no record of its daemon here")
    assert cached_path() == tmp_path / f"p2pd-{recorded[:16]}"
    assert use_unpacked() is None  # nothing there yet: hivemind's own daemon is started
    (tmp_path / "stale").write_bytes(b"")  # a copy for another release is never picked up by name
    assert use_unpacked() is None
    monkeypatch.setenv("OPENDILOCO_UNPACKED_P2PD", "0")
    assert use_unpacked() is None


def test_a_daemon_left_unpacked_in_place_by_an_earlier_version_is_put_back(tmp_path):
    path, backup = tmp_path / "p2pd", tmp_path / ("p2pd" + PACKED_SUFFIX)
    path.write_bytes(b"unpacked")
    backup.write_bytes(b"as shipped")
    assert restore_installed(path, hashlib.sha256(b"something else").hexdigest()) is None  # not pip's: left
    assert path.read_bytes() == b"unpacked"
    assert "back as pip installed it" in restore_installed(path, file_hash(backup))
    assert path.read_bytes() == b"as shipped" and not backup.exists()


@pytest.mark.slow
def test_the_project_starts_its_daemon_from_the_cache_and_peers_reach_it():
    from hivemind.utils import get_dht_time

    from opendiloco.swarm.daemon.node import WorkerBoundDHT, _children

    cached = cached_path()
    if cached is None or not cached.exists():
        lines = install()
        if cached is None or not cached.exists():
            pytest.skip(f"no unpacked daemon here: {lines}")
    first = WorkerBoundDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # as every node of the project
    try:
        daemons = [os.readlink(f"/proc/{pid}/exe") for pid in _children(first.pid)]
        assert str(cached) in daemons, daemons
        second = WorkerBoundDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=[str(a) for a in first.get_visible_maddrs()])
        try:
            assert second.store("key", "value", get_dht_time() + 60)
            found = first.get("key", latest=True)
            assert found is not None and found.value == "value"
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    assert file_hash(daemon_path()) == recorded_hash()


@pytest.mark.parametrize("content", [b"#!/bin/sh\n# UPX! but a script\nexit 0\n", b"\x7fELF UPX! and nothing else"])
def test_a_file_that_is_not_a_packed_daemon_is_not_unpacked(tmp_path, content, capsys):
    path = tmp_path / "p2pd"
    path.write_bytes(content)
    path.chmod(0o755)
    assert is_packed(path)
    with pytest.raises(UnpackError):
        unpack(path, tmp_path / "out" / "p2pd")
    assert path.read_bytes() == content
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert main(["--path", str(path), "--out", str(tmp_path / "out" / "p2pd")]) == 0  # one line, no traceback
    assert "not unpacked" in capsys.readouterr().out
