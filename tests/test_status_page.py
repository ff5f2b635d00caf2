"""``opendiloco status --serve``'s page and its JSON, from a synthetic record table (no DHT, no browser)."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request

import pytest

from opendiloco.cli import main
from opendiloco.swarm.ops.status_page import RunHistory, StatusServer, page_html
from opendiloco.swarm.records import WorkerRecord

PEERS = ["12D3KooWaaa", "12D3KooWbbb", "12D3KooWccc"]


def record(peer, outer, inner, loss, global_hash="h1", **extra):
    return WorkerRecord(peer_id=peer, outer_step=outer, inner_step=inner, loss=loss, global_hash=global_hash,
                        steps_per_s=2.0, contributed_steps=inner, last_sync_time=1000.0 + outer, **extra)


def a_run() -> RunHistory:
    """Three reads: two workers in step, a third that joins, differs, then leaves."""
    h = RunHistory("demo", closed=True, forget_after=100.0)
    h.update(1000.0, [record(PEERS[0], 1, 8, 5.0), record(PEERS[1], 1, 8, 5.1)],
             {PEERS[0]: {"group_size": 2, "seconds": 1.5}}, {PEERS[0]: ["/p2p-circuit/x", "/ip4/10.0.0.1/tcp/31337"]})
    h.update(1010.0, [record(PEERS[0], 2, 16, 4.0), record(PEERS[1], 2, 16, 4.2),
                      record(PEERS[2], 2, 16, 4.4, global_hash="h2")])
    h.update(1020.0, [record(PEERS[0], 3, 24, 3.0), record(PEERS[1], 2, 17, 3.9)])
    return h


def test_the_view_of_a_run():
    view = a_run().view(now=1021.0)
    assert view["run_id"] == "demo" and view["closed"] and view["reads"] == 3 and view["live_workers"] == 2
    by_peer = {w["peer_id"]: w for w in view["workers"]}
    a, b, c = (by_peer[p] for p in PEERS)
    assert [w["peer_id"] for w in view["workers"]] == PEERS  # live first, furthest ahead first
    assert a["live"] and a["outer_step"] == 3 and a["inner_step"] == 24 and a["loss"] == 3.0
    assert a["address"] == "/ip4/10.0.0.1/tcp/31337"  # a direct address rather than a relay
    assert a["last_round"] is None  # that was the round to step 1; step 3's is not known
    assert a["since_sync_s"] == 1021.0 - 1003.0 and a["hash_agrees"] is True
    assert not c["live"] and c["hash_agrees"] is None  # gone: not counted
    assert b["hash_agrees"] is True and view["hashes_at_head"] == 1
    assert view["loss"][PEERS[0]] == [[1000.0, 8, 5.0], [1010.0, 16, 4.0], [1020.0, 24, 3.0]]
    assert [(r["outer_step"], r["workers"], r["first"], r["last"]) for r in view["rounds"]] == [
        (1, 2, 1000.0, 1000.0), (2, 3, 1010.0, 1010.0), (3, 1, 1020.0, 1020.0)]
    assert set(view["workers"][0]) >= {"peer_id", "address", "outer_step", "inner_step", "steps_per_s", "global_hash",
                                       "hash_agrees", "last_round", "contributed_steps", "dropped_steps", "live"}
    json.dumps(view, allow_nan=False)


def test_a_worker_whose_hash_differs_is_shown_so():
    h = RunHistory("demo", closed=False)
    h.update(1.0, [record(PEERS[0], 4, 32, 2.0), record(PEERS[1], 4, 32, 2.0), record(PEERS[2], 4, 32, 2.0, "bad")])
    view = h.view(now=2.0)
    assert {w["peer_id"]: w["hash_agrees"] for w in view["workers"]} == {PEERS[0]: True, PEERS[1]: True,
                                                                       PEERS[2]: False}
    assert view["hashes_at_head"] == 2


def test_a_diverged_loss_is_shown_as_none():
    h = RunHistory("demo", closed=False)
    h.update(1.0, [record(PEERS[0], 1, 8, float("nan")), record(PEERS[1], 1, 8, float("inf"))])
    view = h.view(now=2.0)
    assert [w["loss"] for w in view["workers"]] == [None, None] and view["loss"] == {}
    json.dumps(view, allow_nan=False)


def test_history_is_bounded():
    h = RunHistory("demo", closed=False, max_points=50, max_rounds=5, forget_after=10.0)
    for i in range(400):
        h.update(float(i), [record(PEERS[0], i // 4, i, 5.0 - i / 100)])
    view = h.view(now=400.0)
    points = view["loss"][PEERS[0]]
    assert len(points) <= 50 and points[0][1] == 0 and points[-1][1] == 399  # the whole run's shape
    assert [r["outer_step"] for r in view["rounds"]] == [95, 96, 97, 98, 99]
    h.update(500.0, [])
    assert h.view(now=500.0)["workers"] == []  # gone for longer than forget_after


def test_a_failed_read_is_shown_and_the_figures_kept():
    h = a_run()
    h.failed(1030.0, "SwarmError: the DHT did not answer")
    view = h.view(now=1031.0)
    assert view["error"] == "SwarmError: the DHT did not answer" and view["live_workers"] == 2


@pytest.fixture
def server():
    s = StatusServer(a_run()).start()
    yield s
    s.close()


def fetch(url, method="GET"):
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_the_page_and_its_json_are_served(server):
    assert server.url.startswith("http://127.0.0.1:")
    code, headers, body = fetch(server.url)
    assert code == 200 and headers["Content-Type"] == "text/html; charset=utf-8" and body == page_html()
    assert "default-src 'none'" in headers["Content-Security-Policy"] and headers["Cache-Control"] == "no-store"
    code, headers, body = fetch(server.url + "api/run")
    assert code == 200 and headers["Content-Type"] == "application/json"
    view = json.loads(body)
    assert view["run_id"] == "demo" and len(view["workers"]) == 3
    assert fetch(server.url + "nothing")[0] == 404


def test_the_page_is_read_only(server):
    for method in ("POST", "PUT", "DELETE"):
        assert fetch(server.url + "api/run", method)[0] == 501


def test_the_page_works_offline():
    """Nothing to fetch from elsewhere: no external script, style, font or image; values set as text."""
    html = page_html().decode()
    assert not re.search(r"""(src|href)\s*=|@import|url\(|<link|//cdn""", html)
    urls = set(re.findall(r"https?://[^\s\"'<>]+", html))
    assert urls == {"http://www.w3.org/2000/svg"}  # the SVG namespace, never fetched
    assert "innerHTML" not in html and "fetch(\"api/run\"" in html


def test_bad_serve_values_are_one_line(capsys):
    peer = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGgEAuNWLZb7GVo74gmgpNRfhpY9vUm7b21qfyvqF9wGL"
    for value in ("http", "-1", "70000"):
        assert main(["status", "--swarm.initial-peers", peer, "--serve", value]) == 2
        err = capsys.readouterr().err
        assert err == f"opendiloco status: --serve wants a port number from 0 to 65535, got {value!r}\n", err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["status", "--swarm.initial-peers", peer, "--serve", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"opendiloco status: cannot serve on 127.0.0.1:{port}: Address already in use\n", err


def test_compose_serves_the_page_on_the_hosts_loopback_with_the_run_secret():
    import shlex
    from pathlib import Path

    from opendiloco.cli import build_parser

    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "compose.yaml").read_text())
    page = spec["services"]["status-page"]
    assert page["ports"] == ["127.0.0.1:8080:8080"] and page["secrets"] == ["run_secret"]
    command = page["command"][0].split("exec ", 1)[1].replace("$$", "$")
    args = shlex.split(command.replace('"$(head -n 1 /data/swarm/bootstrap.addrs)"', "/ip4/10.0.0.1/tcp/1/p2p/X"))
    assert args[0] == "opendiloco"
    parsed, rest = build_parser().parse_known_args(args[1:])
    assert not rest and parsed.serve == "8080" and parsed.host == "0.0.0.0"
    assert parsed.secret_file == "/run/secrets/run_secret"
