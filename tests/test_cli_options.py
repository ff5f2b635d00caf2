"""One spelling for each option in every subcommand (a config key's, ``--section.key``), the short
spellings of earlier versions kept as aliases; ``status`` reads the workers' ``--config``."""

from __future__ import annotations

import argparse

import pytest

from opendiloco.cli import build_parser, main
from opendiloco.train.config import ConfigError, parse_overrides

PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL"
OWN_OPTIONS = {"--config", "--addrs-file", "--serve", "--host", "--interval", "--timeout", "--startup-timeout",
               "--resume", "--print-config", "--out", "--title", "--help", "--log-level", "--overwrite"}
"""Options of one subcommand that set no config key."""


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_that_sets_a_config_key_is_spelled_as_the_key_everywhere():
    seen: dict[str, str] = {}
    for name, parser in _subcommands().items():
        for action in parser._actions:
            spellings = [s for s in action.option_strings if s.startswith("--")]
            if not spellings or spellings[0] in OWN_OPTIONS:
                continue
            canonical = spellings[0]
            try:  # the first spelling (the one --help shows) is a config key that train takes as well
                parse_overrides([canonical, "1"] if action.nargs != 0 else [canonical])
            except ConfigError as e:
                if "unknown key" in str(e):
                    pytest.fail(f"opendiloco {name} {canonical}: not spelled as a config key ({e})")
            for old in spellings[1:]:  # an alias is never another subcommand's canonical spelling
                assert seen.get(old, canonical) == canonical, (name, old)
                seen[old] = canonical


@pytest.mark.parametrize("old,new,value", [
    ("--initial-peers", "--swarm.initial-peers", [PEER]),
    ("--host-maddrs", "--swarm.host-maddrs", ["/ip4/127.0.0.1/tcp/0"]),
    ("--announce-maddrs", "--swarm.announce-maddrs", ["/ip4/203.0.113.5/tcp/31337"]),
    ("--identity-path", "--swarm.identity-path", "key"),
    ("--metrics-port", "--run.metrics-port", "9100"),
])
def test_dht_takes_the_config_key_spelling_and_the_old_one(old, new, value):
    parser = build_parser()
    values = value if isinstance(value, list) else [value]
    assert parser.parse_args(["dht", new, *values]) == parser.parse_args(["dht", old, *values])
    assert getattr(parser.parse_args(["dht", new, *values]), new.split(".")[1].replace("-", "_")) == value


def test_status_takes_the_config_key_spelling_and_the_old_one():
    parser = build_parser()
    new = parser.parse_args(["status", "--swarm.initial-peers", PEER, "--swarm.run-id", "r",
                             "--swarm.secret-file", "s"])
    old = parser.parse_args(["status", "--initial-peers", PEER, "--run-id", "r", "--secret-file", "s"])
    assert new == old and (new.initial_peers, new.run_id, new.secret_file) == ([PEER], "r", "s")


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(["status", *argv])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, never a traceback
    return code, err


def test_status_reads_its_peers_run_id_and_secret_from_the_workers_config(tmp_path, capsys):
    config = tmp_path / "worker.toml"
    config.write_text(f'[swarm]\ninitial_peers = ["{PEER}"]\nrun_id = "not an id!"\n')
    code, err = _run(capsys, "--config", str(config))
    assert code == 2 and "'not an id!' is not a run id" in err  # the run id came from the file
    config.write_text(f'[swarm]\ninitial_peers = ["{PEER}"]\nsecret_file = "{tmp_path / "absent.secret"}"\n')
    code, err = _run(capsys, "--config", str(config))
    assert code == 2 and "absent.secret' does not exist" in err  # and the secret file
    code, err = _run(capsys, "--config", str(config), "--swarm.secret-file", str(tmp_path / "mine"))
    assert code == 2 and "mine' does not exist" in err  # an option wins over the file
    config.write_text('[swarm]\ninitial_peers = ["/ip4/127.0.0.1/tcp/1"]\n')
    code, err = _run(capsys, "--config", str(config))
    assert code == 2 and "/ip4/127.0.0.1/tcp/1" in err and "p2p" in err  # and the peers (no peer id: refused)


def test_status_without_a_peer_says_where_to_give_one(tmp_path, capsys):
    code, err = _run(capsys)
    assert code == 2 and "--swarm.initial-peers" in err
    config = tmp_path / "solo.toml"
    config.write_text("[train]\ntotal_steps = 10\n")
    code, err = _run(capsys, "--config", str(config))
    assert code == 2 and "[swarm] initial_peers" in err
    code, err = _run(capsys, "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "no such config file" in err
