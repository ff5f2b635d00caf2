"""Config loading, validation and command-line overrides of the reference trainer."""

import subprocess
import sys
from pathlib import Path

import pytest

from opendiloco.cli import main
from opendiloco.train.config import ConfigError, load_config, parse_overrides, to_toml, validate_config

ROOT = Path(__file__).resolve().parents[1]
PEERS = ["/ip4/10.0.0.1/tcp/1/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL",
         "/dns/example.org/tcp/2/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("toml, fragment", [
    ("[optim]\nlocal_steps = 0\n", "config error: optim.local_steps: must be >= 1"),
    ("[optim]\nlocal_stepz = 5\n", "config error: optim.local_stepz: unknown key"),
    ("[optimizer]\nlr = 1.0\n", "config error: optimizer: unknown key"),
    ("[optim]\nlocal_steps = \"many\"\n", "config error: optim.local_steps: expected an integer"),
    ("[train]\nprecision = \"fp8\"\n", "config error: train.precision: must be one of"),
    ("[swarm]\ninitial_peers = [\"1.2.3.4:31337\"]\n", "config error: swarm.initial_peers:"),
    ("[swarm]\ninitial_peers = [\"/ip4/1.2.3.4/tcp/31337\"]\n", "no /p2p/"),
    ("[data]\nrank = 3\nworld_size = 2\n", "config error: data: rank 3 must be < world_size 2"),
    ("[optim\n", "not valid TOML"),
    # Found by a review: each used to be accepted.
    ("[optim]\nlr = inf\n", "optim.lr: must be a finite number, got inf"),
    ("[model]\ninit_std = inf\n", "model.init_std: must be a finite number, got inf"),
    ("[swarm]\nallreduce_timeout = inf\n", "swarm.allreduce_timeout: must be a finite number, got inf"),
    ("[swarm]\nallreduce_timeout = 1e300\n", "swarm.allreduce_timeout: must be <= 86400"),
    ("[swarm]\nmax_wait = nan\n", "swarm.max_wait: must be a finite number"),
    ("[swarm]\nrun_id = \"\"\n", "swarm.run_id: '' is not a run id"),
    ("[swarm]\nrun_id = \"my run\"\n", "swarm.run_id: 'my run' is not a run id"),
    ("[run]\nworker = \"../other\"\n", "run.worker: '../other' cannot be used"),
    ("[train]\nthrottle = 1e9\n", "train.throttle: must be <= 3600"),
    ("[train]\nseed = -1\n", "train.seed: must be >= 0"),
])
def test_bad_config_file_exits_2_with_one_line(tmp_path, capsys, toml, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    code, out, err = run_cli(capsys, "train", "--config", str(path), "--print-config")  # accepted: prints, exit 0
    assert code == 2
    assert err.startswith("config error: ") and fragment in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("override, fragment", [
    (["--optim.local-steps", "0"], "optim.local_steps: must be >= 1"),
    (["--optim.local-steps", "lots"], "optim.local_steps: expected an integer, got 'lots'"),
    (["--optim.nonsense", "1"], "optim.nonsense: unknown key"),
    (["--bogus.key", "1"], "bogus.key: unknown key"),
    (["--optim.lr"], "optim.lr: needs a value"),
    (["--data.eval-fraction", "1.5"], "data.eval_fraction: must be < 1"),
    (["stray"], "unexpected argument 'stray'"),
    (["--optim.local-steps", "8", "--optim.fragments", "4", "--optim.overlap", "2"], "overlap 2 must be shorter"),
    (["--optim.mix", "2"], "optim.mix: must be <= 1"),
    (["--swarm.compression", "fp4"], "swarm.compression: unknown format 'fp4'; choose one of none, fp16"),
    (["--swarm.result-compression", "zip"], "swarm.result_compression: unknown format 'zip'"),
])
def test_bad_override_exits_2(capsys, override, fragment):
    code, out, err = run_cli(capsys, "train", *override)
    assert code == 2
    assert err.startswith("config error: ") and fragment in err
    assert len(err.strip().splitlines()) == 1


def test_overrides_are_parsed_by_field_type():
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        "--optim.local-steps", "50", "--data.seq-len", "256", "--optim.lr=0.01", "--run.progress", "false",
        "--swarm.initial-peers", *PEERS,
        "--optim.betas", "0.8", "0.99", "--model.tie-embeddings", "--data.shard-seed", "none",
    ])
    assert cfg.optim.local_steps == 50 and cfg.data.seq_len == 256 and cfg.optim.lr == 0.01
    assert cfg.run.progress is False and cfg.model.tie_embeddings is True
    assert cfg.swarm.initial_peers == PEERS
    assert cfg.swarm.enabled  # implied by initial peers
    assert cfg.optim.betas == [0.8, 0.99] and cfg.data.shard_seed is None
    assert cfg.model.hidden_size == 256  # untouched values come from the file


@pytest.mark.parametrize("compression, explicit, expected", [
    ("fp16", None, False), ("int8", None, True), ("int4", None, True), ("e2m1", None, True),
    ("int4", "false", False), ("fp16", "true", True),
])
def test_error_feedback_defaults_to_on_for_the_small_formats(compression, explicit, expected):
    overrides = ["--swarm.compression", compression]
    if explicit is not None:
        overrides += ["--swarm.error-feedback", explicit]
    cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
    assert cfg.swarm.uses_error_feedback is expected


def test_print_config_round_trips(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "train", "-c", str(ROOT / "configs" / "tiny.toml"), "--optim.local-steps", "7",
                           "--print-config")
    assert code == 0
    path = tmp_path / "resolved.toml"
    path.write_text(out)
    assert load_config(path) == load_config(ROOT / "configs" / "tiny.toml", ["--optim.local-steps", "7"])


@pytest.mark.parametrize("name", ["tiny", "150m", "1b"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(ROOT / "configs" / f"{name}.toml")
    assert validate_config(cfg.model_dump()) == cfg
    assert to_toml(cfg)


def test_run_dir_defaults():
    cfg = load_config(None, ["--run.name", "exp", "--run.worker", "w1"])
    assert cfg.run_dir == Path("runs/exp/w1") and cfg.shard_key == "w1"
    cfg = load_config(None, ["--run.worker", "w2", "--swarm.run-id", "swarm7", "--data.shard-seed", "s"])
    assert cfg.run_dir == Path("runs/swarm7/w2") and cfg.shard_key == "s"


def test_parse_overrides_rejects_two_values_for_a_scalar():
    with pytest.raises(ConfigError, match="optim.lr: expected one value"):
        parse_overrides(["--optim.lr", "1", "2"])


def test_cli_subprocess_config_error_is_fast_and_clean():
    proc = subprocess.run([sys.executable, "-m", "opendiloco.cli", "train", "--train.batch-size", "-3"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "config error: train.batch_size: must be >= 1, got -3"


def _fields_of(kind):
    """(section, field) for every config field whose type is ``kind`` (or ``kind | None``)."""
    from opendiloco.train.config import Config

    for section, info in Config.model_fields.items():
        for name, field in info.annotation.model_fields.items():
            args = getattr(field.annotation, "__args__", ())
            if field.annotation is kind or (kind in args and set(args) <= {kind, type(None)}):
                yield section, name


FLOAT_FIELDS = list(_fields_of(float))
INT_FIELDS = list(_fields_of(int))
STR_FIELDS = list(_fields_of(str))


def test_the_systematic_checks_see_every_numeric_and_text_field():
    assert len(FLOAT_FIELDS) >= 19 and len(INT_FIELDS) >= 25 and len(STR_FIELDS) >= 12
    assert ("optim", "lr") in FLOAT_FIELDS and ("swarm", "allreduce_timeout") in FLOAT_FIELDS
    assert ("model", "init_std") in FLOAT_FIELDS and ("swarm", "run_id") in STR_FIELDS


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("section, name", FLOAT_FIELDS, ids=[f"{s}.{n}" for s, n in FLOAT_FIELDS])
def test_every_float_field_refuses_non_finite_values(section, name, value):
    with pytest.raises(ConfigError) as e:
        validate_config({section: {name: value}})
    assert str(e.value).startswith(f"{section}.{name}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("section, name", INT_FIELDS, ids=[f"{s}.{n}" for s, n in INT_FIELDS])
def test_every_int_field_refuses_values_beyond_64_bits(section, name):
    with pytest.raises(ConfigError, match=rf"^{section}\.{name}: "):
        validate_config({section: {name: 2**64}})


@pytest.mark.parametrize("section, name", STR_FIELDS, ids=[f"{s}.{n}" for s, n in STR_FIELDS])
def test_every_text_field_refuses_an_empty_string(section, name):
    with pytest.raises(ConfigError, match=rf"^{section}\.{name}: "):
        validate_config({section: {name: "  "}})


def test_betas_refuse_non_finite_items():
    with pytest.raises(ConfigError, match=r"^optim\.betas"):
        validate_config({"optim": {"betas": [0.9, float("nan")]}})



@pytest.mark.parametrize("peer, fragment", [
    ("/ip4/127.0.0.1/tcp/1/p2p/QmA", "'QmA' is not a peer id"),
    ("/ip4/127.0.0.1/tcp/1/p2p/not-a-peer-id", "'not-a-peer-id' is not a peer id"),
    ("/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9w", "is not a peer id"),  # cut short
])
def test_a_garbage_peer_id_is_refused_before_anything_is_built(tmp_path, peer, fragment):
    """In a subprocess, as users run it: one line, exit 2, and no run dir created (no model built)."""
    run_dir = tmp_path / "run"
    from tests.test_train_loop import SMALL

    proc = subprocess.run([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(run_dir),
                           "--swarm.initial-peers", peer], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error: swarm.initial_peers: ") and fragment in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not run_dir.exists()


def test_real_peer_ids_of_both_kinds_are_accepted():
    peers = ["/ip4/10.0.0.1/tcp/1/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL",
             "/dns/example.org/tcp/2/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]
    assert load_config(None, ["--swarm.initial-peers", *peers]).swarm.initial_peers == peers


def test_the_config_fingerprint_covers_what_workers_must_share_and_nothing_else():
    from opendiloco.train.config import config_fingerprint

    base = config_fingerprint(load_config(None))
    for override in (["--model.num-heads", "8"], ["--model.init-std", "0.01"], ["--model.init-seed", "1"],
                     ["--optim.local-steps", "50"], ["--optim.outer-lr", "0.7"], ["--optim.outer-momentum", "0.5"],
                     ["--optim.fragments", "2"], ["--data.tokenizer", "gpt2"], ["--swarm.weight-by-samples"]):
        assert config_fingerprint(load_config(None, override)) != base, override
    for override in (["--optim.lr", "1e-3"], ["--train.batch-size", "4"], ["--run.worker", "other"],
                     ["--swarm.allreduce-timeout", "5"], ["--data.seq-len", "64"], ["--optim.pace", "fixed"]):
        assert config_fingerprint(load_config(None, override)) == base, override


# -- closed by default: a swarm worker needs a run secret, or an open run chosen explicitly -------------

A_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL"
NO_SECRET_ENV = ("OPENDILOCO_RUN_SECRET", "OPENDILOCO_RUN_SECRET_FILE")


def test_a_swarm_worker_without_a_secret_or_the_open_choice_refuses_in_one_line(tmp_path):
    """As users run it: one line that says how to close the run or open it, exit 2, nothing built or joined."""
    import os

    from tests.test_train_loop import SMALL

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in NO_SECRET_ENV}
    proc = subprocess.run([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(run_dir),
                           "--swarm.initial-peers", A_PEER], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("opendiloco train: this worker would join a swarm without a run secret"), lines[0]
    for advice in ("opendiloco secret FILE", "OPENDILOCO_RUN_SECRET_FILE=FILE", "[swarm] secret_file",
                   "--swarm.open", "vote on the run's state", "stall its rounds"):
        assert advice in lines[0], advice
    assert not run_dir.exists()


@pytest.fixture
def no_secret_env(monkeypatch):
    for name in NO_SECRET_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_an_open_run_is_a_choice_that_says_what_it_allows(no_secret_env, caplog):
    from opendiloco.train.trainer import check_membership

    assert check_membership(load_config(None)) is False  # training alone needs no secret and says nothing
    assert check_membership(load_config(None, ["--swarm.open"])) is False
    assert not caplog.records
    with caplog.at_level("WARNING", logger="opendiloco.train.trainer"):
        assert check_membership(load_config(None, ["--swarm.initial-peers", A_PEER, "--swarm.open"])) is False
    [record] = caplog.records
    said = record.getMessage()
    assert said.startswith("run 'opendiloco' is OPEN"), said
    for allowed in ("anyone who can reach one of its workers can join it", "vote on the run's state",
                    "serve state to workers that join or catch up", "download the model", "stall its rounds",
                    "opendiloco secret FILE"):
        assert allowed in said, allowed
    caplog.clear()
    with caplog.at_level("WARNING", logger="opendiloco.train.trainer"):  # the other processes of a torchrun worker
        check_membership(load_config(None, ["--swarm.initial-peers", A_PEER, "--swarm.open"]), warn=False)
    assert not caplog.records


def test_a_closed_run_needs_no_choice_and_a_secret_cannot_be_open_too(no_secret_env, tmp_path, capsys):
    from opendiloco.errors import SwarmError
    from opendiloco.swarm.membership import new_secret_file
    from opendiloco.train.trainer import check_membership

    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    swarm = ["--swarm.initial-peers", A_PEER]
    assert check_membership(load_config(None, [*swarm, "--swarm.secret-file", str(secret)])) is True
    no_secret_env.setenv("OPENDILOCO_RUN_SECRET_FILE", str(secret))
    assert check_membership(load_config(None, swarm)) is True
    with pytest.raises(SwarmError, match=r"^\[swarm\] open \(--swarm.open\) asks for an open run, but a run secret "
                                         r"is given \(file .*run.secret\)"):
        check_membership(load_config(None, [*swarm, "--swarm.open"]))
    # The CLI says so in one line, before anything is built (a run dir is never made).
    code, out, err = run_cli(capsys, "train", "--run.dir", str(tmp_path / "r"), *swarm, "--swarm.open")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is either closed by its secret or open" in err, err
    no_secret_env.setenv("OPENDILOCO_RUN_SECRET_FILE", str(tmp_path / "missing"))
    code, out, err = run_cli(capsys, "train", "--run.dir", str(tmp_path / "r"), *swarm)
    missing = str(tmp_path / "missing")
    assert code == 2 and err.strip() == f"opendiloco train: run secret file {missing!r} does not exist", err
    assert not (tmp_path / "r").exists()


def test_log_lines_name_warnings_the_same_before_and_after_hivemind_is_imported():
    """hivemind renames the WARNING level to WARN when imported; the CLI's lines keep one name."""
    import logging

    import hivemind  # noqa: F401 - its import is what renames the level

    from opendiloco.cli import LogFormatter

    record = logging.LogRecord("opendiloco.x", logging.WARNING, __file__, 1, "careful", None, None)
    assert logging.getLevelName(logging.WARNING) == "WARN"  # what the old format printed
    assert LogFormatter("%(levelname)s %(message)s").format(record) == "WARNING careful"
