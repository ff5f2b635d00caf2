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
from dataclasses import dataclass, field
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
    begin, end = _run_span(events)
    life = Lifetimes(events, end)
    hosts = world["hosts"]
    workers = sorted(h for h in hosts if h != "bootstrap")
    records = {w: _worker_records(out, w, hosts[w]) for w in workers}
    # The run is warm from its first applied outer step: what came before is start-up, in a clean play too.
    warm = min((r["time"] for recs in records.values() for r in recs if r["event"] == "outer_step" and r.get("ok")),
               default=end)
    per_worker = {w: _worker_figures(w, records[w], hosts[w], life, warm, events, out) for w in workers}
    rounds = _applied_rounds(records)
    membership = _round_membership(rounds, workers, life, _partition_sides(events, world))
    for w in workers:
        ready, took_part = membership.ready[w], membership.took_part[w]
        per_worker[w]["rounds_ready"] = ready
        per_worker[w]["rounds_in"] = took_part
        per_worker[w]["participation"] = round(took_part / ready, 3) if ready else None

    goodput, steady = _goodput(list(per_worker.values()))
    report = {
        "scenario": next((e.get("scenario") for e in events if e["kind"] == "begin"), out.name),
        "workers": per_worker,
        "outer_steps": len(rounds), "groups": sum(len(_groups(recs)) for recs in rounds.values()),
        "hash_agreement": {"steps_checked": len(rounds), "disagreements": _disagreements(rounds),
                           "last_steps_agree": _last_steps_agree(rounds)},
        "full_rounds": membership.full, "partial_rounds": membership.partial[:50],
        "goodput": round(goodput, 4),
        "steady_goodput": round(steady, 4), "warm_after_s": round(warm - begin, 1),
        "longest_stall_s": round(max((p["longest_sync_s"] for p in per_worker.values()), default=0.0), 2),
        "max_wait_s": max_wait,
        "tracebacks": sum(p["tracebacks"] for p in per_worker.values()),
        "faults": [e for e in events if e["kind"] in FAULT_KINDS],
        "transfer": _transfer(per_worker, out, world),
    }
    if clean is not None and clean.get("steady_goodput"):
        report["clean_goodput"] = clean["steady_goodput"]
        report["relative_goodput"] = round(steady / clean["steady_goodput"], 4)
    return report


FAULT_KINDS = ("kill", "freeze", "readdress", "partition", "heal", "link", "kill_bootstrap", "stop", "event_failed")
"""The runner's events that the report lists as faults."""


def _run_span(events: list[dict]) -> tuple[float, float]:
    """(begin, end) of the run on the runner's clock: its ``begin`` and ``stopping`` events, or else the
    first and last event."""
    end = next((e["time"] for e in events if e["kind"] == "stopping"), None) or \
        max((e["time"] for e in events), default=0.0)
    begin = next((e["time"] for e in events if e["kind"] == "begin"), min((e["time"] for e in events), default=end))
    return begin, end


def _worker_records(out: Path, worker: str, host: dict) -> list[dict]:
    """A worker's ``metrics.jsonl`` records, their times moved back to the runner's clock."""
    path = out / "workers" / worker / "metrics.jsonl"
    records = read_metrics(path) if path.exists() else []
    offset = float(host.get("clock_offset_s", 0.0))
    for r in records:
        r["time"] = r["time"] - offset
    return records


def _worker_figures(w: str, recs: list[dict], host: dict, life: Lifetimes, warm: float, events: list[dict],
                    out: Path) -> dict:
    """One worker's figures from its records, its lifetimes and its log (all but round membership)."""
    outer = [r for r in recs if r["event"] == "outer_step"]
    applied = [r for r in outer if r.get("ok")]
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
    launches = life.launches.get(w, [])
    return {
        "region": host["region"], "nat": host.get("nat", False),
        "clock_offset_s": host.get("clock_offset_s", 0.0),
        "launches": len(launches), "live_s": round(life.seconds(w), 1),
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
        "launch_to_first_contribution_s": [_first_contribution_s(launch, applied) for launch in launches],
        "resumed": [resumed_from_checkpoint(s) for s in starts],
        "tracebacks": text.count("Traceback (most recent call last)"),
        "exit_codes": [e.get("code") for e in events if e["kind"] == "exit" and e.get("worker") == w],
        "resume_expected": [bool(launch.get("resumed")) for launch in launches],
    }


def _first_contribution_s(launch: dict, applied: list[dict]) -> float | None:
    """Seconds from a launch to the first applied outer step its worker contributed steps to (None: none)."""
    later = [r for r in applied if r["time"] >= launch["time"] and (r.get("contributed_steps") or 0) > 0]
    return round(later[0]["time"] - launch["time"], 2) if later else None


def _applied_rounds(records: dict[str, list[dict]]) -> dict[int, list[dict]]:
    """Outer step -> the applied ``outer_step`` records of every worker, each tagged with its worker."""
    rounds: dict[int, list[dict]] = defaultdict(list)
    for w, recs in records.items():
        for r in recs:
            if r["event"] == "outer_step" and r.get("ok"):
                rounds[r["outer_step"]].append({"worker": w, **r})
    return rounds


def _disagreements(rounds: dict[int, list[dict]]) -> list[dict]:
    """The outer steps whose applied records hold more than one θ_global hash, with each worker's hash."""
    return [{"outer_step": k, "hashes": {r["worker"]: r.get("global_hash") for r in recs}}
            for k, recs in sorted(rounds.items()) if len({r.get("global_hash") for r in recs}) > 1]


@dataclass
class RoundMembership:
    """Which rounds held everyone that could have been there."""

    full: int = 0
    """Groups that held every worker that was ready for them."""
    partial: list[dict] = field(default_factory=list)
    """The other groups: outer step, members and the ready workers missing."""
    ready: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per worker, the groups it was ready for (alive, past its join, on the group's side of a partition)."""
    took_part: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per worker, the groups it was ready for and was in."""


def _round_membership(rounds: dict[int, list[dict]], workers: list[str], life: Lifetimes,
                      partitions: list[tuple[float, float, dict[str, int]]]) -> RoundMembership:
    """For every group of every applied outer step, the workers that could have been in it against those that were."""
    result = RoundMembership()
    for k, recs in sorted(rounds.items()):
        for groupish in _groups(recs):
            t1 = max(r["time"] for r in groupish)
            t0 = min(r["time"] - (r.get("sync_s") or 0.0) for r in groupish)
            members = {r["worker"] for r in groupish}
            side = next((sides for a, b, sides in partitions if a < t1 and b > t0), None)
            my_side = {side.get(m) for m in members} if side else None
            ready = {w for w in workers if life.alive(w, t0, t1) and _joined(life, w, t0, rounds)
                     and (side is None or side.get(w) in my_side)}
            for w in ready:
                result.ready[w] += 1
                result.took_part[w] += w in members
            if ready <= members:
                result.full += 1
            else:
                result.partial.append({"outer_step": k, "members": sorted(members), "missing": sorted(ready - members)})
    return result


def _goodput(figures: list[dict]) -> tuple[float, float]:
    """(goodput over the whole run, goodput from the run's first applied outer step on) of the workers' figures."""
    live = sum(p["live_s"] for p in figures)
    useful = sum(p["useful_s"] for p in figures)
    warm_live = sum(p["warm_live_s"] for p in figures)
    steady = sum(p["warm_useful_s"] for p in figures) / warm_live if warm_live else 0.0
    return (useful / live if live else 0.0), steady


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


def _joined(life: Lifetimes, w: str, t0: float, rounds: dict) -> bool:
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
