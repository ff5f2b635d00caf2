"""What a played scenario cost and whether the swarm kept its promises, from the records it left.

Reads the runner's ``events.jsonl`` (launches, exits, faults, on the runner's clock), every
worker's ``metrics.jsonl`` (its clock corrected by the host's known offset) and the logs, and
computes:

- goodput: the share of the time workers were alive (not frozen, not dead) that went into inner
  steps which ended in an applied outer step, over the whole run; ``steady_goodput``, the same
  from the run's first applied outer step on (a run's start-up is no fault, and a shorter clean
  play holds a larger share of it); ``relative_goodput`` divides the steady figure by the same
  figure of the scenario played without faults;
- hash agreement: at every outer step, the workers that applied it hold one θ_global hash;
- full rounds: applied rounds whose group held every worker that was alive, past its join, and
  on the same side of any partition during the round;
- per worker: rounds it was ready for and took part in, its longest stall in an outer step,
  launch to first contributed outer step (joiners and restarts), whether a restart resumed from
  its checkpoint, tracebacks in its log;
- per link class: transfer efficiency (bytes sent / transfer time / the link's rate).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from ..train.metrics import read_metrics


def _events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class Lifetimes:
    """When each worker was alive and not frozen, on the runner's clock, from ``events.jsonl``."""

    def __init__(self, events: list[dict], end: float):
        self.launches: dict[str, list[dict]] = defaultdict(list)
        self.segments: dict[str, list[list[float]]] = defaultdict(list)
        frozen_at: dict[str, float] = {}
        for e in events:
            w = e.get("worker")
            if e["kind"] == "launch":
                self.launches[w].append(e)
                self.segments[w].append([e["time"], end])
            elif e["kind"] in ("exit", "kill") and self.segments.get(w) and self.segments[w][-1][1] == end:
                self.segments[w][-1][1] = e["time"]
            elif e["kind"] == "freeze" and self.segments.get(w):
                frozen_at[w] = e["time"]
                self.segments[w][-1][1] = e["time"]
            elif e["kind"] == "thaw" and w in frozen_at:
                self.segments[w].append([e["time"], end])
                del frozen_at[w]
        for segs in self.segments.values():  # an exit after a freeze, a kill of a stopped one
            segs[:] = [s for s in segs if s[1] > s[0]]

    def alive(self, worker: str, t0: float, t1: float) -> bool:
        """Alive and running during the whole of [t0, t1]."""
        return any(a <= t0 and t1 <= b for a, b in self.segments.get(worker, []))

    def seconds(self, worker: str, since: float = float("-inf")) -> float:
        """Seconds alive and running, from ``since`` on."""
        return sum(max(0.0, b - max(a, since)) for a, b in self.segments.get(worker, []))


def _partition_sides(events: list[dict], world: dict) -> list[tuple[float, float, dict[str, int]]]:
    """(start, end, host -> side) for every partition, on the runner's clock."""
    out, current = [], None
    region = {h: v["region"] for h, v in world.get("hosts", {}).items()}
    end = max((e["time"] for e in events), default=0.0)
    for e in events:
        if e["kind"] == "partition":
            sides = {r: i for i, g in enumerate(e["groups"]) for r in g}
            current = (e["time"], {h: sides.get(r, -1) for h, r in region.items()})
        elif e["kind"] == "heal" and current is not None:
            out.append((current[0], e["time"], current[1]))
            current = None
    if current is not None:
        out.append((current[0], end, current[1]))
    return out


def resumed_from_checkpoint(start: dict) -> bool:
    """Whether a worker's launch (its ``start`` record) restored a checkpoint. The record's own flag, and
    nothing else: a restart whose checkpoint the run had moved past adopts the run's state and starts
    at the run's position, which early in a run can be inner step 0 (the CI scenario's restart once
    read as fresh so)."""
    return start.get("resumed") is True


def analyse(out_dir: str | Path, max_wait: float | None = None, clean: dict | None = None) -> dict:
    """The report of one played scenario (``clean``: the report of the same world without faults)."""
    out = Path(out_dir)
    world = json.loads((out / "world.json").read_text())
    events = _events(out)
    end = next((e["time"] for e in events if e["kind"] == "stopping"), None) or \
        max((e["time"] for e in events), default=0.0)
    begin = next((e["time"] for e in events if e["kind"] == "begin"), min((e["time"] for e in events), default=end))
    life = Lifetimes(events, end)
    partitions = _partition_sides(events, world)
    hosts = world["hosts"]
    workers = sorted(h for h in hosts if h != "bootstrap")

    rounds: dict[int, list[dict]] = defaultdict(list)  # outer step -> the applied records
    per_worker: dict[str, dict] = {}
    records: dict[str, list[dict]] = {}
    for w in workers:
        offset = float(hosts[w].get("clock_offset_s", 0.0))
        path = out / "workers" / w / "metrics.jsonl"
        records[w] = read_metrics(path) if path.exists() else []
        for r in records[w]:
            r["time"] = r["time"] - offset  # back to the runner's clock
    # The run is warm from its first applied outer step: what came before is start-up, in a clean play too.
    warm = min((r["time"] for recs in records.values() for r in recs if r["event"] == "outer_step" and r.get("ok")),
               default=end)
    for w in workers:
        recs = records[w]
        outer = [r for r in recs if r["event"] == "outer_step"]
        applied = [r for r in outer if r.get("ok")]
        for r in applied:
            rounds[r["outer_step"]].append({"worker": w, **r})
        steps = sum(r.get("steps") or 0 for r in outer)
        compute = sum(r.get("round_compute_s") or 0.0 for r in outer)
        step_s = compute / steps if steps else None
        # A round this worker's contribution went into counts even where it adopted the group's state
        # instead of applying the average itself (``ok`` is false there, its steps contributed).
        contributed = sum(r.get("contributed_steps") or 0 for r in outer)
        dropped = sum(r.get("dropped_steps") or 0 for r in outer)
        starts = [r for r in recs if r["event"] == "start"]
        log = out / "logs" / f"{w}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        first_contrib = []
        for launch in life.launches.get(w, []):
            later = [r for r in applied if r["time"] >= launch["time"] and (r.get("contributed_steps") or 0) > 0]
            first_contrib.append(round(later[0]["time"] - launch["time"], 2) if later else None)
        per_worker[w] = {
            "region": hosts[w]["region"], "nat": hosts[w].get("nat", False),
            "clock_offset_s": hosts[w].get("clock_offset_s", 0.0),
            "launches": len(life.launches.get(w, [])), "live_s": round(life.seconds(w), 1),
            "outer_steps_applied": len(applied), "rounds_failed": sum(1 for r in outer if not r.get("ok")),
            "rounds_held": sum(1 for r in outer if r.get("held") is True),
            "caught_up": sum(1 for r in outer if "caught up" in (r.get("reason") or "")
                             or "healed drift" in (r.get("reason") or "")),
            "inner_steps": steps, "contributed_steps": contributed, "dropped_steps": dropped,
            "step_s": step_s,
            "useful_s": contributed * step_s if step_s else 0.0,
            "warm_useful_s": step_s * sum(r.get("contributed_steps") or 0 for r in outer if r["time"] > warm)
            if step_s else 0.0,
            "warm_live_s": life.seconds(w, warm),
            "longest_sync_s": max((r.get("sync_s") or 0.0 for r in outer), default=0.0),
            "launch_to_first_contribution_s": first_contrib,
            "resumed": [resumed_from_checkpoint(s) for s in starts],
            "tracebacks": text.count("Traceback (most recent call last)"),
            "exit_codes": [e.get("code") for e in events if e["kind"] == "exit" and e.get("worker") == w],
        }
        per_worker[w]["resume_expected"] = [bool(launch.get("resumed")) for launch in life.launches.get(w, [])]

    # θ_global agreement per outer step, and which rounds held everyone that could have been there.
    disagreements, full, partial_rounds = [], 0, []
    rounds_ready: dict[str, int] = defaultdict(int)
    rounds_in: dict[str, int] = defaultdict(int)
    for k, recs in sorted(rounds.items()):
        hashes = {r.get("global_hash") for r in recs}
        if len(hashes) > 1:
            disagreements.append({"outer_step": k, "hashes": {r["worker"]: r.get("global_hash") for r in recs}})
        for groupish in _groups(recs):
            t1 = max(r["time"] for r in groupish)
            t0 = min(r["time"] - (r.get("sync_s") or 0.0) for r in groupish)
            members = {r["worker"] for r in groupish}
            side = next((sides for a, b, sides in partitions if a < t1 and b > t0), None)
            my_side = {side.get(m) for m in members} if side else None
            ready = {w for w in workers if life.alive(w, t0, t1) and _joined(per_worker, life, w, t0, rounds)
                     and (side is None or side.get(w) in my_side)}
            for w in ready:
                rounds_ready[w] += 1
                rounds_in[w] += w in members
            if ready <= members:
                full += 1
            else:
                partial_rounds.append({"outer_step": k, "members": sorted(members), "missing": sorted(ready - members)})
    n_groups = sum(len(_groups(recs)) for recs in rounds.values())
    for w in workers:
        per_worker[w]["rounds_ready"] = rounds_ready[w]
        per_worker[w]["rounds_in"] = rounds_in[w]
        per_worker[w]["participation"] = round(rounds_in[w] / rounds_ready[w], 3) if rounds_ready[w] else None

    live = sum(per_worker[w]["live_s"] for w in workers)
    useful = sum(per_worker[w]["useful_s"] for w in workers)
    goodput = useful / live if live else 0.0
    warm_live = sum(per_worker[w]["warm_live_s"] for w in workers)
    steady = sum(per_worker[w]["warm_useful_s"] for w in workers) / warm_live if warm_live else 0.0
    report = {
        "scenario": next((e.get("scenario") for e in events if e["kind"] == "begin"), out.name),
        "workers": per_worker,
        "outer_steps": len(rounds), "groups": n_groups,
        "hash_agreement": {"steps_checked": len(rounds), "disagreements": disagreements,
                           "last_steps_agree": _last_steps_agree(rounds)},
        "full_rounds": full, "partial_rounds": partial_rounds[:50],
        "goodput": round(goodput, 4),
        "steady_goodput": round(steady, 4), "warm_after_s": round(warm - begin, 1),
        "longest_stall_s": round(max((p["longest_sync_s"] for p in per_worker.values()), default=0.0), 2),
        "max_wait_s": max_wait,
        "tracebacks": sum(p["tracebacks"] for p in per_worker.values()),
        "faults": [e for e in events if e["kind"] in ("kill", "freeze", "readdress", "partition", "heal", "link",
                                                     "kill_bootstrap", "stop", "event_failed")],
        "transfer": _transfer(per_worker, out, world),
    }
    if clean is not None and clean.get("steady_goodput"):
        report["clean_goodput"] = clean["steady_goodput"]
        report["relative_goodput"] = round(steady / clean["steady_goodput"], 4)
    return report


def _last_steps_agree(rounds: dict[int, list[dict]], last: int = 5) -> bool:
    """No split lasts: the last ``last`` outer steps applied by two or more workers hold one hash each
    (a fork that the run healed shows in ``disagreements``, not here). Per worker, an outer step's last
    application is the one that stands: a worker that applied a step alone, healed back to the run's
    state and applied the step again with the others has not split the run."""
    standing = {k: list({r["worker"]: r for r in sorted(recs, key=lambda r: r["time"])}.values())
                for k, recs in rounds.items()}
    shared = [k for k in sorted(standing) if len(standing[k]) >= 2][-last:]
    return bool(shared) and all(len({r.get("global_hash") for r in standing[k]}) == 1 for k in shared)


def _groups(recs: list[dict]) -> list[list[dict]]:
    """The applied records of one outer step, split by the group they were in (by peers list)."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        by[tuple(sorted(r.get("peers") or [r["worker"]]))].append(r)
    return list(by.values())


def _joined(per_worker: dict, life: Lifetimes, w: str, t0: float, rounds: dict) -> bool:
    """True once the worker's current launch has been in an applied round before ``t0`` (it is past
    its join and download, so a round could be expected to hold it)."""
    launches = [launch["time"] for launch in life.launches.get(w, []) if launch["time"] <= t0]
    if not launches:
        return False
    since = launches[-1]
    return any(r["worker"] == w and since <= r["time"] <= t0 for recs in rounds.values() for r in recs)


def _transfer(per_worker: dict, out: Path, world: dict) -> dict:
    """Bytes sent / transfer time against the slowest link a worker's rounds cross, per link class."""
    links = world.get("links", {})
    regions = sorted({v["region"] for v in world["hosts"].values()})
    classes: dict[str, list[float]] = defaultdict(list)
    for w, p in per_worker.items():
        path = out / "workers" / w / "metrics.jsonl"
        if not path.exists():
            continue
        mine = p["region"]
        rates = [links.get(f"{a}|{b}", {}).get("rate_mbit") for a in regions for b in regions
                 if mine in (a, b)]
        rates = [r for r in rates if r]
        if not rates:
            continue
        slowest = min(rates)
        for r in read_metrics(path):
            if r["event"] == "outer_step" and r.get("ok") and r.get("transfer_s") and r.get("bytes_sent"):
                mbit = r["bytes_sent"] * 8 / 1e6 / r["transfer_s"]
                classes[f"{slowest:g} Mbit/s"].append(mbit / slowest)
    return {k: {"median_efficiency": round(statistics.median(v), 4), "rounds": len(v)} for k, v in classes.items()}


def summary(report: dict) -> str:
    """A short text of the report's headline figures."""
    lines = [f"scenario {report['scenario']}: {report['outer_steps']} outer steps, {report['groups']} groups"]
    g = (f"goodput {report['goodput']:.1%}; from the first outer step on ({report['warm_after_s']:.0f}s) "
         f"{report['steady_goodput']:.1%}")
    if "relative_goodput" in report:
        g += f" ({report['relative_goodput']:.1%} of the same world without faults, {report['clean_goodput']:.1%})"
    lines.append(g)
    dis = report["hash_agreement"]["disagreements"]
    lines.append(f"hash agreement: {report['hash_agreement']['steps_checked'] - len(dis)} of "
                 f"{report['hash_agreement']['steps_checked']} outer steps agree; the last ones "
                 + ("agree" if report["hash_agreement"]["last_steps_agree"] else "DO NOT agree (a lasting split)"))
    lines.append(f"full rounds: {report['full_rounds']} of {report['groups']}")
    lines.append(f"longest stall in an outer step: {report['longest_stall_s']:.1f}s"
                 + (f" (max_wait {report['max_wait_s']:g}s)" if report.get("max_wait_s") else ""))
    lines.append(f"tracebacks: {report['tracebacks']}")
    for w, p in report["workers"].items():
        part = f"{p['participation']:.0%}" if p["participation"] is not None else "-"
        first = ", ".join("-" if x is None else f"{x:.0f}s" for x in p["launch_to_first_contribution_s"])
        lines.append(f"  {w:<10} {p['region']:<6}{' nat' if p['nat'] else '    '} launches {p['launches']} "
                     f"rounds {p['rounds_in']}/{p['rounds_ready']} ({part}) contributed {p['contributed_steps']} "
                     f"dropped {p['dropped_steps']} held {p.get('rounds_held', 0)} first-contribution [{first}] "
                     f"longest sync {p['longest_sync_s']:.1f}s")
    for k, v in report["transfer"].items():
        lines.append(f"transfer efficiency over {k}: {v['median_efficiency']:.1%} (median of {v['rounds']} rounds)")
    return "\n".join(lines)
