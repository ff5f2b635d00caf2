"""One path from the config to the swarm's settings, the solo round written once, and the typed
progress record a worker publishes (issue #27)."""

from __future__ import annotations

import dataclasses
import sys
import threading
import types

import pytest
import torch

from opendiloco.comm import SingleWorker
from opendiloco.comm.aggregation import Aggregation
from opendiloco.comm.base import PROGRESS_FIELDS, Communicator, Progress, check_progress
from opendiloco.comm.formats import get_codec
from opendiloco.comm.local import average_alone
from opendiloco.errors import AveragingError, SwarmError
from opendiloco.swarm.presence import OtherSettings, Presence
from opendiloco.swarm.records import WorkerRecord
from opendiloco.swarm.settings import SwarmSettings
from opendiloco.train.config import SwarmConfig, fingerprint_covers, load_config

NOT_DEFAULT = {
    "run_id": "other-run", "compression": "int8", "result_compression": "fp16", "min_group_size": 3,
    "matchmaking_timeout": 7.0, "allreduce_timeout": 9.0, "straggler_wait": 2.5, "max_attempts": 5,
    "verify_timeout": 1.5, "poll_interval": 0.5, "quiet_poll_interval": 2.0, "max_wait": 42.0, "part_numel": 4096,
    "aggregation": "centered-clip", "clip_ratio": 2.0, "max_weight_ratio": 3.0, "audit_chunks": 7,
    "exclude_rounds": 3, "partition_hold": 30.0, "cut_off_after": 40.0,
}
"""A valid value, other than the default, for every ``[swarm]`` key that sets a ``SwarmSettings`` field."""
AGGREGATION_KEYS = {"aggregation", "clip_ratio", "max_weight_ratio"}


def test_every_swarm_setting_is_a_config_key_or_said_not_to_be():
    """A field added to SwarmSettings without a [swarm] key of the same name (or a place in
    NOT_FROM_CONFIG, with its reason in its docstring and docs/config.md) fails here."""
    settings = {f.name for f in dataclasses.fields(SwarmSettings)}
    keys = set(SwarmConfig.model_fields)
    missing = settings - keys - SwarmSettings.NOT_FROM_CONFIG
    assert not missing, f"SwarmSettings fields with no [swarm] key: {sorted(missing)}"
    assert not SwarmSettings.NOT_FROM_CONFIG & keys, "a field said not to come from the config has a key"
    assert SwarmSettings.NOT_FROM_CONFIG <= settings
    assert settings - SwarmSettings.NOT_FROM_CONFIG == (set(NOT_DEFAULT) - AGGREGATION_KEYS) | {"aggregation"}


def test_from_config_carries_every_key_to_its_setting():
    cfg = load_config(None, [f"--swarm.{k}={v}" for k, v in NOT_DEFAULT.items()]).swarm
    for key, value in NOT_DEFAULT.items():
        assert getattr(cfg, key) == value, key
        assert value != SwarmConfig.model_fields[key].default, key  # else it would prove nothing
    settings = SwarmSettings.from_config(cfg, "fp-1234")
    for key in set(NOT_DEFAULT) - AGGREGATION_KEYS:
        assert getattr(settings, key) == NOT_DEFAULT[key], key
    assert settings.aggregation == Aggregation("centered-clip", clip_ratio=2.0, max_weight_ratio=3.0)
    assert settings.config_fingerprint == "fp-1234"
    default = SwarmSettings()
    for name in SwarmSettings.NOT_FROM_CONFIG - {"config_fingerprint"}:
        assert getattr(settings, name) == getattr(default, name), name


def test_the_config_defaults_are_the_librarys():
    assert SwarmSettings.from_config(SwarmConfig()) == SwarmSettings()


@pytest.mark.parametrize("override, message", [
    (["--swarm.part-numel", "1500"], "swarm.part_numel: must be a multiple of 1024"),
    (["--swarm.part-numel", "512"], "swarm.part_numel: must be >= 1024"),
    (["--swarm.part-numel", str(1 << 25)], "swarm.part_numel: must be <= 16777216"),
    (["--swarm.max-attempts", "0"], "swarm.max_attempts: must be >= 1"),
    (["--swarm.verify-timeout", "0"], "swarm.verify_timeout: must be > 0"),
    (["--swarm.verify-timeout", "1e9"], "swarm.verify_timeout: must be <= 86400"),
    (["--swarm.poll-interval", "0"], "swarm.poll_interval: must be >= 0.001"),
    (["--swarm.record-ttl", "30"], "swarm.record_ttl: unknown key"),
    (["--swarm.heartbeat-interval", "1"], "swarm.heartbeat_interval: unknown key"),
])
def test_the_new_keys_are_checked(override, message):
    from opendiloco.train.config import ConfigError

    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(None, override)


# -- the refusal of other settings names the swarm's setting; the trainer names its keys ----------

def test_other_settings_name_the_fingerprint_and_the_trainer_names_its_keys(tmp_path, monkeypatch):
    from opendiloco.train import startup
    from opendiloco.train.config import FINGERPRINT_KEYS

    refusal = OtherSettings("worker 3fd1a2b9 of run 'r' trains with other settings (config fingerprint a, this "
                            "worker's b)")
    assert isinstance(refusal, SwarmError) and "optim." not in str(refusal) and "[model]" not in str(refusal)
    assert str(refusal).endswith("(config fingerprint a, this worker's b): the settings its config fingerprint "
                                 "covers must be the same on every worker")

    def refuse(swarm, run_dir, config_fingerprint):
        raise refusal

    fake = types.ModuleType("opendiloco.swarm.communicator")
    fake.SwarmCommunicator = types.SimpleNamespace(from_config=refuse)
    monkeypatch.setitem(sys.modules, "opendiloco.swarm.communicator", fake)
    cfg = load_config(None, ["--swarm.enabled"])
    with pytest.raises(OtherSettings) as raised:
        startup.make_communicator(cfg, tmp_path)
    said = str(raised.value)
    assert said == (f"{refusal.detail}: {fingerprint_covers()} must be the same on every worker (compare their "
                    "--print-config)")
    assert "\n" not in said and "the [model] section, data.tokenizer, optim.local_steps, optim.fragments" in said
    for section, keys in FINGERPRINT_KEYS.items():  # what the message names is what the fingerprint covers
        for name in keys or ():
            assert f"{section}.{name}" in said
        assert keys is not None or f"the [{section}] section" in said


def test_the_swarm_layer_names_no_trainer_key_in_its_messages():
    """The text of every call (errors raised, lines logged) in the communicator, its start and its presence."""
    import ast
    from pathlib import Path

    swarm = Path(__file__).resolve().parents[1] / "opendiloco" / "swarm"
    for path in [swarm / "communicator.py", swarm / "startup.py", swarm / "presence.py"]:
        said = [node.value for call in ast.walk(ast.parse(path.read_text())) if isinstance(call, ast.Call)
                for arg in [*call.args, *(k.value for k in call.keywords)] for node in ast.walk(arg)
                if isinstance(node, ast.Constant) and isinstance(node.value, str)]
        assert any("trains with other settings" in text for text in said) or path.name != "startup.py"
        for key in ("[swarm]", "[model]", "optim.", "--swarm.", "data.tokenizer", "--print-config"):
            assert not [text for text in said if key in text], (path.name, key)


# -- the solo round, written once ----------------------------------------------------------------

@pytest.mark.parametrize("codec", ["fp16", "int4"])
def test_a_group_of_one_averages_alone_the_same_everywhere(codec):
    flat = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    out, err = torch.empty_like(flat), torch.empty_like(flat)
    average_alone(get_codec(codec), flat, 2.0, out, err, chunk=1024)  # the swarm's chunk: its part size
    result = SingleWorker(codec).start(flat, weight=2.0, key=None, error_out=(err2 := torch.empty_like(flat))).wait()
    assert torch.equal(result.flat, out) and torch.equal(err2, err) and result.total_weight == 2.0
    assert torch.equal(out, get_codec(codec).roundtrip(flat)) and torch.equal(err, flat - out)
    with pytest.raises(AveragingError, match="alone in the group and contributing weight 0"):
        average_alone(get_codec(codec), flat, 0.0, out)
    with pytest.raises(AveragingError, match="contributing weight 0"):
        SingleWorker(codec).start(flat, weight=0.0, key=None).wait()


# -- the typed progress record -------------------------------------------------------------------

def test_a_record_is_the_progress_and_what_presence_adds():
    progress = {f.name for f in dataclasses.fields(Progress)}
    added = {"peer_id", "time", "left", "config", "relays", "abandoned", "addrs", "moves"}
    assert {f.name for f in dataclasses.fields(WorkerRecord)} == progress | added
    assert set(PROGRESS_FIELDS) == progress | {"ready_in"}
    assert WorkerRecord("p", outer_step=4).heading == 4  # the peer id stays the one positional field


def test_the_wire_format_of_a_record_is_unchanged():
    """Workers of another version read these keys: the record keeps every name, type and default."""
    value = WorkerRecord("p").to_value()
    assert value == {
        "outer_step": -1, "inner_step": 0, "samples_per_s": 0.0, "loss": None, "global_hash": "",
        "last_sync_time": 0.0, "ready_at": None, "ready": False, "next_round": -1, "round_work": 0.0,
        "work_rate": 0.0, "work_per_step": 0.0, "pace_time": 0.0, "steps_per_s": 0.0, "contributed_steps": 0,
        "dropped_steps": 0, "time": 0.0, "left": False, "config": "", "name": "", "relays": (), "abandoned": "",
        "addrs": (), "moves": 0,
    }  # keys are only added (a reader of another version ignores those it does not know)
    rec = WorkerRecord.of(Progress(outer_step=3, loss=1.5, ready=True, name="eu-1"), peer_id="p", time=9.0,
                          left=False, config="c", abandoned="a" * 24, addrs=("/ip4/10.0.0.2/tcp/31337",), moves=2)
    assert WorkerRecord.from_value("p", rec.to_value()) == rec
    for bad in (7, "a" * 65):  # a record is input from the network: a malformed one is dropped
        assert WorkerRecord.from_value("p", {**rec.to_value(), "abandoned": bad}) is None
    for bad in (-1, 1 << 40, 1.0, True, "3", None):
        assert WorkerRecord.from_value("p", {**rec.to_value(), "moves": bad}) is None


@pytest.mark.parametrize("fields, message", [
    ({"outer_stpe": 3}, r"unknown field\(s\) \['outer_stpe'\]"),
    ({"outer_step": 3.0}, "outer_step must be int, got float"),
    ({"ready": 1}, "ready must be bool, got int"),
    ({"inner_step": True}, "inner_step must be int, got bool"),
    ({"loss": torch.tensor(1.0)}, "loss must be int or float or None, got Tensor"),
])
def test_a_misspelt_or_mistyped_progress_field_fails_at_the_call_on_every_communicator(fields, message):
    with pytest.raises(TypeError, match=message):
        check_progress(fields)
    with pytest.raises(TypeError, match=message):
        SingleWorker().report_progress(**fields)
    presence = Presence.__new__(Presence)  # report() checks its fields before it touches anything else
    presence._lock = threading.Lock()
    with pytest.raises(TypeError, match=message):
        presence.report(**fields)


def test_what_the_trainer_and_optimizer_report_passes():
    check_progress(dict(outer_step=3, inner_step=40, samples_per_s=12.5, loss=2.25, global_hash="ab", name="w"))
    check_progress(dict(round_work=0, work_rate=1.5, work_per_step=16.0, ready=False, next_round=4, ready_in=None,
                        steps_per_s=0.0, contributed_steps=10, dropped_steps=0))
    check_progress(dict(ready_in=0.0, last_sync_time=1e9, loss=None))


def test_local_ranks_refuse_a_misspelt_field_on_every_rank():
    from opendiloco.comm.ranks import LocalRanks

    follower = LocalRanks.__new__(LocalRanks)
    follower.leader = None
    with pytest.raises(TypeError, match="outer_stpe"):
        follower.report_progress(outer_stpe=1)
    follower.report_progress(outer_step=1)
    assert Communicator.report_progress is not LocalRanks.report_progress


@pytest.mark.parametrize("changes, refused", [
    ({}, None),
    ({"part_numel": 2048}, None),
    ({"min_group_size": 0}, "min_group_size"),
    ({"part_numel": 1000}, "part_numel"),
    ({"part_numel": 1536}, "part_numel"),
    ({"part_numel": 2048.0}, "part_numel"),
])
def test_settings_no_round_can_run_with_are_refused_before_a_communicator_starts(changes, refused):
    settings = dataclasses.replace(SwarmSettings(), **changes)
    if refused is None:
        settings.check()
    else:
        with pytest.raises(ValueError, match=refused):
            settings.check()


def test_the_matchmakers_records_live_as_long_as_a_round_may_wait_and_exchange():
    settings = SwarmSettings(run_id="r", max_wait=100.0, matchmaking_timeout=20.0, allreduce_timeout=30.0,
                             config_fingerprint="fp")
    given = settings.matchmaking_settings()
    assert given.record_ttl == 150.0 and given.run_id == "r" and given.config == "fp"
    assert given.part_numel == settings.part_numel and given.min_group_size == settings.min_group_size
