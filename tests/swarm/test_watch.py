"""Seeing a run: a closed 2-worker swarm of ``opendiloco train`` scraped by Prometheus' format (and by a
real Prometheus where one is installed), and ``opendiloco status --serve`` read by a headless Chromium.

One swarm serves every check; the workers train until the test stops them (SIGTERM), so the page and
the scrapes see rounds pass whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks.headless import Browser, BrowserError, find_chromium
from benchmarks.network import free_port
from opendiloco.swarm.membership import new_secret_file
from opendiloco.train.metrics import read_metrics
from tests.test_train_loop import SMALL

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(360)]
ROOT = Path(__file__).resolve().parents[2]


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return answer.read().decode()


def wait_until(what: str, check, timeout: float, poll: float = 0.3, why=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f}s\n{why()}"
        time.sleep(poll)


def scrape(url: str) -> dict[str, float | dict]:
    """The samples of a /metrics answer, parsed with prometheus_client's own parser: name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for family in text_string_to_metric_families(get(url)):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}"
                            if s.labels else "")
            out[key] = s.value
    return out


def expected_after(records: list[dict]) -> dict:
    """What a worker's exporter must show once it has written ``records`` (computed from metrics.jsonl)."""
    rounds = [r for r in records if r["event"] == "outer_step"]
    train = [r for r in records if r["event"] == "train"]
    out = {"opendiloco_inner_step": float(records[-1]["inner_step"]),
           "opendiloco_outer_step": float(records[-1]["outer_step"]),
           "opendiloco_contributed_steps_total": float(sum(r["contributed_steps"] for r in rounds)),
           "opendiloco_dropped_steps_total": float(sum(r["dropped_steps"] for r in rounds)),
           "opendiloco_sent_bytes_total": float(sum(r["bytes_sent"] or 0 for r in rounds)),
           'opendiloco_rounds_total{result="ok"}': float(sum(1 for r in rounds if r["ok"]))}
    if train:
        out["opendiloco_train_loss"] = train[-1]["loss"]
        out["opendiloco_tokens_per_second"] = train[-1]["tokens_per_s"]
    if rounds:
        out["opendiloco_group_size"] = float(rounds[-1]["group_size"])
        out["opendiloco_round_loss"] = rounds[-1]["loss"]
        out['opendiloco_last_round_seconds{phase="transfer"}'] = rounds[-1]["transfer_s"]
        out['opendiloco_last_round_seconds{phase="waiting"}'] = rounds[-1]["matchmaking_s"]
        out[f'opendiloco_global_info{{hash="{rounds[-1]["global_hash"]}"}}'] = 1.0
    return out


def matches_a_prefix(samples: dict, records: list[dict]) -> int | None:
    """The number of records after which the exporter showed exactly ``samples`` (None if after none):
    the file is written before the exporter hears of a record, so a scrape is some prefix of the file."""
    for n in range(len(records), 0, -1):
        want = expected_after(records[:n])
        if all(samples.get(k) == v for k, v in want.items() if v is not None):
            return n
    return None


def test_prometheus_and_the_status_page_see_a_closed_two_worker_run(swarm, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENDILOCO_RUN_SECRET", raising=False)
    monkeypatch.delenv("OPENDILOCO_RUN_SECRET_FILE", raising=False)
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))
    peers_file = tmp_path / "peers.txt"
    boot = swarm.spawn([sys.executable, "-m", "opendiloco", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                        "--addrs-file", str(peers_file), "--metrics-port", "0"], "bootstrap")
    said = wait_until("the bootstrap's metrics address",
                      lambda: re.search(r"metrics for Prometheus at (\S+)", swarm.log("bootstrap")), 90,
                      why=lambda: swarm.log("bootstrap"))
    assert boot.poll() is None
    dht_metrics = said.group(1)
    peers = peers_file.read_text().split()
    run = ["--swarm.initial-peers", *peers, "--swarm.run-id", "watched"]

    # The page of the run, with its secret and without.
    pages = {}
    for name, extra in (("page", ["--secret-file", str(secret)]), ("outsider", [])):
        swarm.spawn([sys.executable, "-m", "opendiloco", "status", *run, "--serve", "0", "--interval", "1", *extra],
                    name)
    for name in ("page", "outsider"):
        pages[name] = wait_until(f"{name}'s address", lambda n=name: re.search(r"status page of run 'watched': (\S+)",
                                                                              swarm.log(n)), 90,
                                 why=lambda n=name: swarm.log(n)).group(1)

    dirs, procs = {}, []
    for name in ("a", "b"):
        dirs[name] = tmp_path / name
        procs.append(swarm.spawn([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(dirs[name]),
                                  "--run.worker", name, "--train.throttle", "0.15", "--train.total-steps", "100000",
                                  "--optim.local-steps", "8", *run, "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                  "--swarm.min-group-size", "2", "--swarm.join-timeout", "1",
                                  "--run.metrics-port", "0"], name,
                                 env={"OPENDILOCO_RUN_SECRET_FILE": str(secret)}))

    def records(name):
        path = dirs[name] / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []

    def rounds_done(name):
        return sum(1 for r in records(name) if r["event"] == "outer_step" and r["ok"] and r["group_size"] == 2)

    def logs():
        return "\n".join(f"--- {n}\n{swarm.log(n)}" for n in ("a", "b", "page"))

    wait_until("two rounds of 2 in both workers", lambda: min(rounds_done("a"), rounds_done("b")) >= 2, 180,
               why=logs)
    urls = {name: next(r["metrics_url"] for r in records(name) if r["event"] == "start") for name in dirs}
    assert all(u.startswith("http://127.0.0.1:") for u in urls.values()), urls  # 127.0.0.1 unless asked

    # 1. Each worker's figures are those of its metrics.jsonl.
    for name, url in urls.items():
        samples = scrape(url)
        n = matches_a_prefix(samples, records(name))
        assert n is not None, (name, {k: v for k, v in samples.items() if k.startswith("opendiloco")},
                               records(name)[-3:])
        assert samples["opendiloco_group_size"] == 2 and samples["opendiloco_sent_bytes_total"] > 0
        me = records(name)[0]["peer_id"]
        assert samples[f'opendiloco_worker_info{{peer_id="{me}",worker="{name}"}}'] == 1
        assert samples["opendiloco_peers_seen"] == 1 and samples["process_cpu_seconds_total"] > 0
    dht = scrape(dht_metrics)
    assert dht["opendiloco_dht_up"] == 1 and dht["opendiloco_dht_routing_table_peers"] >= 1, dht

    # 2. A real Prometheus scrapes the workers and the bootstrap (where Debian's package is installed).
    if shutil.which("prometheus"):
        check_with_prometheus(swarm, tmp_path, [u.removeprefix("http://").removesuffix("/metrics")
                                                for u in [*urls.values(), dht_metrics]], records)

    # 3. The JSON the page polls: both workers live, with the run's figures; nothing without the secret.
    def run_view(name):
        return json.loads(get(pages[name] + "api/run"))

    view = wait_until("the page's reader sees both workers", lambda: (v := run_view("page"))["live_workers"] == 2
                      and all(w["outer_step"] >= 2 for w in v["workers"]) and v, 120, why=logs)
    ids = {records(n)[0]["peer_id"] for n in dirs}
    assert {w["peer_id"] for w in view["workers"]} == ids and view["closed"] is True
    names = {records(n)[0]["peer_id"]: n for n in dirs}  # each worker's [run] worker, from its record
    assert {w["peer_id"]: w["name"] for w in view["workers"]} == names, view["workers"]
    assert all(w["global_hash"] and w["hash_agrees"] in (True, None) for w in view["workers"])
    assert set(view["loss"]) <= ids and view["rounds"]
    wait_until("a worker's last round (its group of 2)", lambda: any(
        (w.get("last_round") or {}).get("group_size") == 2 for w in run_view("page")["workers"]), 60, why=logs)
    outsider = run_view("outsider")
    assert outsider["reads"] >= 1 and outsider["workers"] == [] and outsider["closed"] is False, outsider

    # 4. The page in a real browser: it shows both live workers and follows the rounds without a reload.
    binary = find_chromium()
    if binary is None:
        pytest.skip("the page was served and its JSON checked; no chromium on PATH for the browser part "
                    "(apt-get install chromium)")
    try:
        browser = Browser(binary, timeout=60)
    except (BrowserError, OSError) as e:
        pytest.skip(f"the page was served and its JSON checked; chromium cannot start here: {e}")
    with browser:
        try:
            page = browser.page(pages["page"])
        except BrowserError as e:
            pytest.skip(f"the page was served and its JSON checked; chromium cannot open a page here: {e}")
        page.wait_for("document.body.dataset.live === '2' && document.querySelectorAll('#workers tr.live').length",
                      60)
        head = int(page.evaluate("document.body.dataset.head"))
        renders = int(page.evaluate("document.body.dataset.renders"))
        shown = page.evaluate("[...document.querySelectorAll('#workers tr.live')].map(r => r.dataset.peer)")
        assert set(shown) == ids
        cells = page.evaluate("[...document.querySelectorAll('#workers tr.live td:first-child')]"
                              ".map(c => c.textContent)")
        assert sorted(c.split(" …")[0] for c in cells) == sorted(names.values()), cells
        assert page.evaluate("document.querySelectorAll('#loss path').length") >= 1
        page.wait_for(f"+document.body.dataset.head > {head} && +document.body.dataset.renders > {renders}", 120)
        assert page.evaluate("document.querySelectorAll('#rounds circle').length") >= 2
        page.screenshot(tmp_path / "status_page.png")
        assert (tmp_path / "status_page.png").stat().st_size > 10_000
        if os.environ.get("OPENDILOCO_SCREENSHOT"):  # how docs/status_page.png was made
            shutil.copy(tmp_path / "status_page.png", os.environ["OPENDILOCO_SCREENSHOT"])

    # The workers stop cleanly with their exporters on.
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    swarm.wait(procs, timeout=60)
    for name in dirs:
        assert records(name)[-1]["event"] == "end", records(name)[-1]


def check_with_prometheus(swarm, tmp_path: Path, targets: list[str], records) -> None:
    """Prometheus 2 (Debian's ``prometheus``) scraping every second: each target up, each worker's figures."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
                      "scrape_configs:\n  - job_name: opendiloco\n    static_configs:\n"
                      f"      - targets: {json.dumps(targets)}\n")
    swarm.spawn(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"], "prometheus")

    def query(q):
        try:
            answer = json.loads(get(f"http://127.0.0.1:{port}/api/v1/query?query={urllib.request.quote(q)}"))
        except OSError:
            return []
        return answer["data"]["result"]

    wait_until("Prometheus to scrape all targets", lambda: len([r for r in query("up") if r["value"][1] == "1"])
               == len(targets), 90, why=lambda: swarm.log("prometheus"))
    steps = wait_until("Prometheus to hold both workers' outer steps",
                       lambda: (r := query("opendiloco_outer_step")) and len(r) == 2 and r, 60)
    assert all(float(r["value"][1]) >= 2 for r in steps), steps
    assert float(query("opendiloco_dht_routing_table_peers")[0]["value"][1]) >= 1
    contributed = {r["metric"]["instance"]: float(r["value"][1]) for r in query("opendiloco_contributed_steps_total")}
    assert len(contributed) == 2 and all(v > 0 for v in contributed.values()), contributed
    # The queries docs/observability.md suggests for Grafana answer (once two scrapes make a rate).
    for q in GRAFANA_QUERIES:
        wait_until(f"an answer to {q}", lambda q=q: query(q), 30, why=lambda: swarm.log("prometheus"))
    assert query("count(count by (hash) (opendiloco_global_info))")[0]["value"][1] in ("1", "2")  # 2: mid-round


GRAFANA_QUERIES = [
    "opendiloco_train_loss", "opendiloco_outer_step", "rate(opendiloco_sent_bytes_total[1m])",
    "increase(opendiloco_dropped_steps_total[1m])", "sum by (phase) (rate(opendiloco_round_seconds_total[1m]))",
    "count(count by (hash) (opendiloco_global_info))",
    "rate(opendiloco_compute_seconds_total[1m]) / (rate(opendiloco_compute_seconds_total[1m])"
    " + sum without(phase) (rate(opendiloco_round_seconds_total[1m])))",
]
