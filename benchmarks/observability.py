"""What seeing a run costs (issue 28): a Prometheus scrape against a worker's step time, and the status
page's render time for a 16-worker run in headless Chromium. Each figure is a ratio against a baseline
measured in the same run.

    python -m benchmarks.observability                 # both; about 2 minutes on 2 CPU cores
    python -m benchmarks.observability --only page --screenshot docs/status_page_16.png

1. Scrape: one worker trains ``configs/tiny.toml`` (one process, no swarm) with ``[run] metrics_port``
   on. A second process scrapes it; it is paused (SIGSTOP) and resumed (SIGCONT) in alternate blocks
   of inner steps, so both halves share the machine's load. Figures: the median inner step without
   scraping (the baseline); one scrape's round trip as the scraper sees it (an upper bound of the
   worker's cost per scrape) and the worker's own part of it (its figures made into text); and the
   median step while scraped once a second (15 times Prometheus' default rate).
2. Page: a synthetic 16-worker run (500 loss points per worker, 30 rounds) served by ``StatusServer``;
   Chromium opens the page in a fresh tab 5 times; the time from navigation to the end of the first
   render (``statusPage.firstRenderMs``: the HTML, the JSON, the tables and the SVG), against the same
   page of a run with no worker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRAPER = r"""
import sys, time, urllib.request
url, interval = sys.argv[1], float(sys.argv[2])
while True:
    began = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            answer.read()
    except OSError:  # the worker has finished
        break
    print(time.perf_counter() - began, flush=True)
    time.sleep(interval)
"""


def scrape_cost(steps: int, block: int, interval: float) -> dict:
    from opendiloco.train.config import load_config
    from opendiloco.train.trainer import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix="bench-scrape-"))
    cfg = load_config(ROOT / "configs/tiny.toml", ["--run.dir", str(run_dir), "--run.metrics-port", "0",
                                                    "--run.progress", "false", "--train.total-steps", str(steps),
                                                    "--train.threads", "1", "--checkpoint.every-outer-steps", "0"])
    trainer = Trainer(cfg)
    times: dict[str, list[float]] = {"off": [], "on": []}
    state = {"scraper": None, "mode": "off", "step": 0}

    def after_step(step_s: float):  # step_s: the seconds Trainer.train_step took
        times[state["mode"]].append(step_s)
        state["step"] += 1
        if state["step"] == 1:  # the exporter is up: start the scraper, paused
            state["registry"] = next(x for x in trainer.metrics.forward.sinks if x.name == "prometheus").registry
            state["scraper"] = subprocess.Popen([sys.executable, "-c", SCRAPER, trainer.metrics_url, str(interval)],
                                                stdout=subprocess.PIPE, text=True)
            os.kill(state["scraper"].pid, signal.SIGSTOP)
        elif state["step"] % block == 0:
            state["mode"] = "on" if state["mode"] == "off" else "off"
            os.kill(state["scraper"].pid, signal.SIGCONT if state["mode"] == "on" else signal.SIGSTOP)

    trainer.on_step = after_step
    try:
        trainer.run()
    finally:
        scraper = state["scraper"]
        if scraper is not None:
            scraper.terminate()
            os.kill(scraper.pid, signal.SIGCONT)  # a stopped process gets its SIGTERM once continued
            out, _ = scraper.communicate(timeout=30)
    trips = [float(x) for x in out.split()]
    from prometheus_client import generate_latest

    serve = []
    for _ in range(200):  # the worker's own work per scrape: its figures as text (no socket, no HTTP)
        began = time.perf_counter()
        generate_latest(state["registry"])
        serve.append(time.perf_counter() - began)
    off = statistics.median(times["off"][5:])  # the first steps warm up
    on = statistics.median(times["on"])
    trip = statistics.median(trips)
    return {"steps_off": len(times["off"]), "steps_on": len(times["on"]), "scrapes": len(trips),
            "step_s_baseline": off, "step_s_scraped": on, "scrape_round_trip_s": trip,
            "text_s": statistics.median(serve), "text_over_step": statistics.median(serve) / off,
            "scrape_over_step": trip / off, "scraped_step_over_baseline": on / off,
            "prometheus_default_interval_cost": trip / 15.0,  # share of the worker's time at one scrape per 15 s
            "scrape_interval_s": interval}


def synthetic_run(workers: int, points: int = 500, rounds: int = 30):
    from opendiloco.swarm.ops.status_page import RunHistory

    h = RunHistory("bench", closed=True, max_points=points, max_rounds=rounds)
    peers = [f"12D3KooW{'x' * 38}Bench{i:02d}" for i in range(workers)]
    t0 = time.time() - points * 2.0
    for r in range(points):
        h.update(t0 + 2.0 * r, [dict(peer_id=p, outer_step=r * rounds // points, inner_step=4 * r, steps_per_s=2.0,
                                     samples_per_s=32.0, loss=6.0 - 3.0 * r / points + 0.01 * (i % 5),
                                     global_hash="3f2a9c1d7e5b4a60", last_sync_time=t0 + 2.0 * r,
                                     contributed_steps=4 * r, dropped_steps=0, ready=False)
                                for i, p in enumerate(peers)],
                 {p: {"group_size": workers, "seconds": 1.5} for p in peers},
                 {p: [f"/ip4/10.0.{i}.1/tcp/31337"] for i, p in enumerate(peers)})
    return h


def page_render(trials: int, workers: int, screenshot: Path | None) -> dict:
    from benchmarks.headless import Browser
    from opendiloco.swarm.ops.status_page import RunHistory, StatusServer

    def measure(history, shot=None):
        server = StatusServer(history).start()
        try:
            with Browser(timeout=60) as browser:
                found = []
                for _ in range(trials):
                    page = browser.page(server.url)
                    page.wait_for("document.body.dataset.renders", 60, poll=0.05)
                    found.append(page.evaluate("[statusPage.firstRenderMs, statusPage.lastRenderMs]"))
                    if shot is not None:
                        page.screenshot(shot)
                        shot = None
                    page.send("Page.close")
            size = len(json.dumps(history.view()))
        finally:
            server.close()
        return [f[0] for f in found], [f[1] for f in found], size

    empty = RunHistory("bench", closed=True)
    empty.update(time.time(), [])
    base_load, base_render, base_size = measure(empty)
    load, render, size = measure(synthetic_run(workers), screenshot)
    return {"workers": workers, "trials": trials, "json_bytes": size, "json_bytes_empty": base_size,
            "load_ms_empty": statistics.median(base_load), "load_ms": statistics.median(load),
            "render_ms": statistics.median(render), "render_ms_empty": statistics.median(base_render),
            "load_ms_all": load, "load_over_empty": statistics.median(load) / statistics.median(base_load)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["scrape", "page"], default=None)
    p.add_argument("--steps", type=int, default=200, help="inner steps of the scraped worker")
    p.add_argument("--block", type=int, default=20, help="inner steps per block (scraped, then not)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes while scraping")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--screenshot", type=Path, default=None, help="also keep a picture of the 16-worker page")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    results = {"command": "python -m benchmarks.observability " + " ".join(argv or sys.argv[1:]),
               "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    if args.only in (None, "scrape"):
        results["scrape"] = scrape_cost(args.steps, args.block, args.interval)
    if args.only in (None, "page"):
        results["page"] = page_render(args.trials, args.workers, args.screenshot)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
