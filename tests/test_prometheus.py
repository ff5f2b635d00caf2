"""The worker's Prometheus exporter, fed with records as metrics.jsonl holds them (no training, no swarm)."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from opendiloco.cli import main
from opendiloco.train.prometheus import PrometheusSink, start_exporter
from opendiloco.train.sinks import SinkSet

RECORDS = [
    {"event": "start", "worker": "eu1", "peer_id": "12D3KooWme", "inner_step": 0, "outer_step": 0},
    {"event": "train", "inner_step": 10, "outer_step": 0, "loss": 5.25, "lr": 3e-4, "tokens_per_s": 1234.5,
     "grad_norm": 0.75},
    {"event": "outer_step", "outer_step": 1, "inner_step": 20, "loss": 5.0, "eval_loss": None, "ok": True,
     "group_size": 3, "peers": ["12D3KooWme", "12D3KooWb", "12D3KooWc"], "allreduce_s": 1.5, "sync_s": 2.0,
     "transfer_s": 1.0, "matchmaking_s": 0.25, "bytes_sent": 1000, "bytes_received": 900, "round_compute_s": 6.0,
     "global_hash": "aa11", "contributed_steps": 20, "dropped_steps": 0},
    {"event": "eval", "inner_step": 20, "outer_step": 1, "eval_loss": 4.5, "perplexity": 90.0},
    {"event": "outer_step", "outer_step": 2, "inner_step": 40, "loss": 4.75, "eval_loss": 4.25, "ok": False,
     "group_size": 1, "peers": ["12D3KooWme", "12D3KooWd"], "allreduce_s": 0.5, "sync_s": 0.75,
     "transfer_s": None, "matchmaking_s": 0.5, "bytes_sent": 500, "bytes_received": None, "round_compute_s": 3.0,
     "global_hash": "bb22", "contributed_steps": 0, "dropped_steps": 20},
    {"event": "outer_step", "outer_step": 2, "inner_step": 45, "loss": 4.5, "ok": False, "held": True,
     "group_size": 1, "peers": [], "sync_s": 0.0, "round_compute_s": 0.0, "global_hash": "bb22"},
    {"event": "checkpoint", "inner_step": 40, "outer_step": 2, "blocked_s": 0.125},
]


@pytest.fixture
def exporter():
    sink = PrometheusSink(0)
    yield sink
    sink.close()


def scrape(url: str):
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain")
        return list(text_string_to_metric_families(answer.read().decode()))


def samples(families) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_a_scrape_shows_the_records_figures(exporter):
    sinks = SinkSet([exporter])
    for record in RECORDS:
        sinks(record)
    got = samples(scrape(exporter.url))

    def value(name, **labels):
        return got[(name, tuple(sorted(labels.items())))]

    assert value("opendiloco_inner_step") == 40 and value("opendiloco_outer_step") == 2
    assert value("opendiloco_train_loss") == 5.25 and value("opendiloco_tokens_per_second") == 1234.5
    assert value("opendiloco_learning_rate") == 3e-4 and value("opendiloco_grad_norm") == 0.75
    assert value("opendiloco_eval_loss") == 4.25 and value("opendiloco_round_loss") == 4.5
    assert value("opendiloco_group_size") == 1
    assert value("opendiloco_peers_seen") == 3  # b, c, d: never itself
    assert value("opendiloco_rounds_total", result="ok") == 1 and value("opendiloco_rounds_total", result="failed") == 2
    assert value("opendiloco_held_rounds_total") == 1
    assert value("opendiloco_sent_bytes_total") == 1500 and value("opendiloco_received_bytes_total") == 900
    assert value("opendiloco_contributed_steps_total") == 20 and value("opendiloco_dropped_steps_total") == 20
    assert value("opendiloco_round_seconds_total", phase="waiting") == 0.75
    assert value("opendiloco_round_seconds_total", phase="transfer") == 1.0
    assert value("opendiloco_round_seconds_total", phase="apply") == 0.5 + 0.25
    assert value("opendiloco_last_round_seconds", phase="waiting") == 0.5
    assert value("opendiloco_last_round_seconds", phase="transfer") == 1.0  # the failed round told none
    assert value("opendiloco_compute_seconds_total") == 9.0
    assert value("opendiloco_round_utilisation_ratio") == 3.0 / 3.75
    assert value("opendiloco_checkpoints_total") == 1 and value("opendiloco_last_checkpoint_blocked_seconds") == 0.125
    assert value("opendiloco_global_info", hash="bb22") == 1
    assert value("opendiloco_worker_info", peer_id="12D3KooWme", worker="eu1") == 1
    assert not any(name == "opendiloco_global_info" and labels != (("hash", "bb22"),) for name, labels in got)


def test_names_follow_prometheus_conventions(exporter):
    families = scrape(exporter.url)
    ours = [f for f in families if f.name.startswith("opendiloco_")]
    assert len(ours) >= 25
    for f in ours:
        assert f.documentation, f.name
        if f.type == "counter":
            assert all(s.name in (f.name + "_total", f.name + "_created") for s in f.samples), f.name
        if f.name.endswith("seconds") or f.type == "counter" and "second" in f.name:
            assert f.name.endswith("_seconds"), f.name
        assert not re.search(r"_s$|_s_|_ms$|_ms_|per_s$|_bytes_sent", f.name), f.name  # base units, spelled out
        assert f.name == f.name.lower()
    names = {s.name for f in families for s in f.samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names


def test_metrics_are_served_on_127_0_0_1_unless_asked(exporter):
    assert exporter.host == "127.0.0.1" and exporter._server.server_address[0] == "127.0.0.1"
    assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"


def test_a_port_in_use_is_one_line(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as e:
            start_exporter(port, "127.0.0.1")
        assert str(e.value) == f"run.metrics_port: cannot serve metrics on 127.0.0.1:{port}: Address already in use"
        code = main(["train", "--run.dir", str(tmp_path / "run"), "--run.metrics-port", str(port),
                     "--model.hidden-size", "32", "--model.num-layers", "1", "--model.num-heads", "4",
                     "--model.intermediate-size", "64", "--data.seq-len", "16", "--train.total-steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == f"error: run.metrics_port: cannot serve metrics on 127.0.0.1:{port}: " \
                                "Address already in use", err


def test_a_bad_port_is_a_config_error(capsys):
    assert main(["train", "--run.metrics-port", "70000", "--print-config"]) == 2
    assert "metrics_port" in capsys.readouterr().err


def test_a_bad_dht_metrics_port_is_one_line(capsys):
    assert main(["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--metrics-port", "nine"]) == 2
    assert capsys.readouterr().err == "opendiloco dht: --metrics-port wants a port number from 0 to 65535, got 'nine'\n"
