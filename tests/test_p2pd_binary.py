"""Unpacking hivemind's UPX-packed p2p daemon (``opendiloco/swarm/p2pd_binary.py``, run by setup).

The unpacked daemon must be the very program the packed one runs: the same bytes every time it is
made, answering as the packed one does, and a daemon that hivemind starts and peers reach.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from opendiloco.swarm.p2pd_binary import PACKED_SUFFIX, UnpackError, _usage, daemon_path, is_packed, main, unpack

pytestmark = pytest.mark.timeout(120)


def _packed_daemon() -> Path:
    """The daemon as hivemind's wheel ships it: installed, or kept beside the unpacked one by setup."""
    installed = daemon_path()
    packed = installed if is_packed(installed) else installed.with_name(installed.name + PACKED_SUFFIX)
    if not packed.exists() or not is_packed(packed):
        pytest.skip("no UPX-packed p2pd here (hivemind's wheel ships one for x86-64 Linux)")
    return packed


def test_the_unpacked_daemon_is_the_same_program_and_answers_as_the_packed_one(tmp_path):
    packed = _packed_daemon()
    copy = tmp_path / "p2pd"
    shutil.copy2(packed, copy)
    try:
        line = unpack(copy)
    except UnpackError as e:
        pytest.skip(f"cannot unpack here: {e}")
    assert "unpacked" in line
    assert not is_packed(copy) and is_packed(tmp_path / ("p2pd" + PACKED_SUFFIX))
    assert _usage(copy) == _usage(packed)
    installed = daemon_path()
    if not is_packed(installed):  # setup unpacked it: the same bytes, made the same way
        assert copy.read_bytes() == installed.read_bytes()
    assert unpack(copy).endswith("not packed, left as it is")
    main(["--path", str(copy), "--restore"])
    assert copy.read_bytes() == packed.read_bytes()


def test_a_daemon_hivemind_starts_from_the_unpacked_program_serves_peers():
    """The suite's DHT nodes use whatever setup left installed; this one checks two talk to each other."""
    import hivemind
    from hivemind.utils import get_dht_time

    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              initial_peers=[str(a) for a in first.get_visible_maddrs()])
        try:
            assert second.store("key", "value", get_dht_time() + 60)
            found = first.get("key", latest=True)
            assert found is not None and found.value == "value"
        finally:
            second.shutdown()
    finally:
        first.shutdown()


@pytest.mark.parametrize("content", [b"#!/bin/sh\n# UPX! but a script\nexit 0\n", b"\x7fELF UPX! and nothing else"])
def test_a_file_that_is_not_a_packed_daemon_is_left_as_it_was(tmp_path, content, capsys):
    path = tmp_path / "p2pd"
    path.write_bytes(content)
    path.chmod(0o755)
    assert is_packed(path)
    with pytest.raises(UnpackError):
        unpack(path)
    assert path.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p2pd"]
    assert main(["--path", str(path)]) == 0  # at install: one line, and the install goes on
    assert "left packed" in capsys.readouterr().out
