"""A world and a schedule for the swarm, read from a TOML scenario file.

A scenario names regions and the links inside and between them, the hosts (a bootstrap DHT
node and workers, some behind NAT, some with a clock that is off), the training command every
worker runs (a base config plus overrides), and a schedule of events: workers that join, crash
and come back, freeze, change address; regions cut off and healed; the bootstrap dying; a link
that gets lossy for a while. ``scenario_runner.py`` plays it with the real ``opendiloco`` CLI in
network namespaces; ``scenario_report.py`` turns what the workers wrote into figures.

Everything here is validated up front, so a typo in a scenario is one clear line, not a run
that fails ten minutes in.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ScenarioError(ValueError):
    """A scenario file that cannot be played (one line, naming the place)."""


ACTIONS = {
    "start": "start a worker that is not running yet (a joiner)",
    "kill": "SIGKILL a worker with its DHT process and p2p daemon (a crashed machine)",
    "restart": "start a killed or stopped worker again, from its checkpoint (--resume)",
    "stop": "SIGTERM a worker: it checkpoints and leaves",
    "freeze": "SIGSTOP a worker's whole process tree for `for_s` seconds, then SIGCONT",
    "readdress": "give a worker (or its NAT router) a new address; the old one is gone",
    "partition": "cut the regions into `groups` that cannot reach one another",
    "heal": "end a partition",
    "link": "change the link between two regions (`between`) for `for_s` seconds (or for good)",
    "kill_bootstrap": "SIGKILL the bootstrap DHT node",
    "restart_bootstrap": "start the bootstrap again (same identity, same address)",
}
"""Every event a schedule may hold, and what it does."""

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,15}$")


@dataclass(frozen=True)
class Link:
    delay_ms: float = 0.0
    """One way; a round trip across the link costs twice this."""
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float | None = None


@dataclass(frozen=True)
class Host:
    name: str
    region: str
    nat: bool = False
    clock_offset_s: float = 0.0
    """The host's wall clock is this far off (``faketime.py``): the DHT records it writes carry absolute times."""
    start_at: float | None = 0.0
    """Seconds into the run at which it starts; None: only when a `start` event says so."""
    throttle: float | None = None
    """Seconds of sleep per inner step (a slower machine); None: the scenario's default."""


@dataclass(frozen=True)
class Event:
    at: float
    action: str
    worker: str | None = None
    for_s: float | None = None
    groups: tuple[tuple[str, ...], ...] = ()
    between: tuple[str, str] | None = None
    link: Link | None = None
    wait_for: str | None = None
    """``"checkpoint"``: held (and the schedule behind it) until its worker has written a checkpoint,
    so that a crash is always one it can resume from, however slowly the worker started."""


@dataclass
class Scenario:
    name: str
    duration_s: float
    regions: dict[str, Link]
    """Each region's link between two of its own hosts."""
    links: dict[frozenset, Link]
    """Links between two regions (unordered); a pair not named uses ``default_link``."""
    default_link: Link
    bootstrap_region: str
    workers: list[Host]
    events: list[Event]
    config: str = "configs/tiny.toml"
    overrides: dict[str, object] = field(default_factory=dict)
    """``[train]`` keys passed to every worker as ``--section.key value``."""
    throttle: float = 0.0
    source: Path | None = None
    settle_rounds: int | None = None
    """End early: once the schedule has played and every running worker has contributed to this many
    applied rounds since the last event (and since its launch). ``duration_s`` stays the bound."""

    def worker(self, name: str) -> Host:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(name)

    def link_between(self, a: str, b: str) -> Link:
        if a == b:
            return self.regions[a]
        return self.links.get(frozenset((a, b)), self.default_link)

    def without_faults(self, duration_s: float | None = None) -> Scenario:
        """The same world and joins, with no fault (for ``duration_s``, default the same): the
        baseline goodput is measured against."""
        duration = self.duration_s if duration_s is None else duration_s
        keep = [e for e in self.events if e.action == "start" and e.at < duration]
        return Scenario(self.name + "-clean", duration, self.regions, self.links, self.default_link,
                        self.bootstrap_region, self.workers, keep, self.config, dict(self.overrides),
                        self.throttle, self.source, self.settle_rounds)


def _link(raw: dict, where: str) -> Link:
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: expected a table")
    unknown = set(raw) - {"delay_ms", "jitter_ms", "loss", "rate_mbit", "between"}
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {sorted(unknown)}")
    vals = {}
    for k in ("delay_ms", "jitter_ms", "loss", "rate_mbit"):
        if k in raw:
            v = raw[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ScenarioError(f"{where}.{k}: expected a number >= 0, got {v!r}")
            vals[k] = float(v)
    if vals.get("loss", 0.0) >= 1:
        raise ScenarioError(f"{where}.loss: a probability below 1, got {vals['loss']}")
    if "rate_mbit" in vals and vals["rate_mbit"] <= 0:
        raise ScenarioError(f"{where}.rate_mbit: must be positive")
    if vals.get("jitter_ms", 0.0) > vals.get("delay_ms", 0.0):
        raise ScenarioError(f"{where}: jitter_ms may not exceed delay_ms")
    return Link(**vals)


def _number(raw: dict, key: str, where: str, default=None, *, positive: bool = False):
    v = raw.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (positive and v == 0):
        raise ScenarioError(f"{where}.{key}: expected a number {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise ScenarioError(f"{path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML: {e}") from None
    try:
        return parse_scenario(raw, source=path)
    except ScenarioError as e:
        raise ScenarioError(f"{path}: {e}") from None


def parse_scenario(raw: dict, source: Path | None = None) -> Scenario:
    known = {"name", "duration_s", "settle_rounds", "config", "throttle", "regions", "links", "default_link",
             "bootstrap", "workers", "events", "train"}
    unknown = set(raw) - known
    if unknown:
        raise ScenarioError(f"unknown key(s) {sorted(unknown)}")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ScenarioError("name: 1-16 lowercase letters, digits or dashes, starting with a letter")
    duration = _number(raw, "duration_s", "", positive=True)
    if duration is None:
        raise ScenarioError("duration_s is required (every run is bounded)")
    settle = raw.get("settle_rounds")
    if settle is not None and (isinstance(settle, bool) or not isinstance(settle, int) or not 1 <= settle <= 100):
        raise ScenarioError(f"settle_rounds: a whole number of rounds, 1..100, got {settle!r}")
    regions = _regions(raw.get("regions"))
    links = _links(raw.get("links", []), regions)
    default = _link(raw.get("default_link", {}), "default_link")
    boot = raw.get("bootstrap", {})
    if not isinstance(boot, dict) or boot.get("region", next(iter(regions))) not in regions:
        raise ScenarioError(f"bootstrap.region: one of {sorted(regions)}")
    workers = [host for i, w in enumerate(raw.get("workers", [])) for host in _hosts(w, f"workers[{i}]", regions)]
    names = [w.name for w in workers]
    if not workers:
        raise ScenarioError("workers: at least one [[workers]]")
    if len(set(names)) != len(names) or "bootstrap" in names:
        raise ScenarioError("workers: names must be distinct (and not 'bootstrap')")
    events = [_event(e, i, regions, set(names), duration) for i, e in enumerate(raw.get("events", []))]
    events.sort(key=lambda e: e.at)
    config = raw.get("config", "configs/tiny.toml")
    train = raw.get("train", {})
    if not isinstance(train, dict) or not all(isinstance(v, (str, int, float, bool)) and "." in k
                                              for k, v in train.items()):
        raise ScenarioError("train: a table of \"section.key\" = value overrides")
    return Scenario(name, duration, regions, links, default, boot.get("region", next(iter(regions))), workers,
                    events, config, dict(train), _number(raw, "throttle", "", 0.0), source, settle)


def _regions(raw) -> dict[str, Link]:
    """The ``[regions.NAME]`` tables: each region's link inside it."""
    if not isinstance(raw, dict) or not raw:
        raise ScenarioError("regions: at least one [regions.NAME] table")
    regions = {}
    for r, spec in raw.items():
        if not _NAME.match(r):
            raise ScenarioError(f"regions.{r}: a region name is 1-16 lowercase letters, digits or dashes")
        regions[r] = _link(spec, f"regions.{r}")
    return regions


def _links(raw: list, regions: dict[str, Link]) -> dict[frozenset, Link]:
    """The ``[[links]]`` tables: the link between two different regions, by the unordered pair."""
    links = {}
    for i, spec in enumerate(raw):
        between = spec.get("between") if isinstance(spec, dict) else None
        if not (isinstance(between, list) and len(between) == 2 and all(b in regions for b in between)
                and between[0] != between[1]):
            raise ScenarioError(f"links[{i}].between: two different regions of [regions], got {between!r}")
        links[frozenset(between)] = _link(spec, f"links[{i}]")
    return links


def _hosts(w: dict, where: str, regions: dict[str, Link]) -> list[Host]:
    """The hosts of one ``[[workers]]`` table: ``count`` of them, named ``NAME-1``.. where there are several."""
    if not isinstance(w, dict):
        raise ScenarioError(f"{where}: expected a table")
    unknown = set(w) - {"name", "region", "nat", "clock_offset_s", "start_at", "count", "throttle"}
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {sorted(unknown)}")
    wname = w.get("name")
    if not isinstance(wname, str) or not _NAME.match(wname):
        raise ScenarioError(f"{where}.name: 1-16 lowercase letters, digits or dashes")
    if w.get("region") not in regions:
        raise ScenarioError(f"{where}.region: one of {sorted(regions)}, got {w.get('region')!r}")
    count = w.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
        raise ScenarioError(f"{where}.count: 1..64")
    start_at = w.get("start_at", 0.0)
    if start_at is not False:
        start_at = _number(w, "start_at", where, 0.0)
    offset = w.get("clock_offset_s", 0.0)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or abs(offset) > 3600:
        raise ScenarioError(f"{where}.clock_offset_s: a number of seconds within +-3600")
    nat = w.get("nat", False)
    if not isinstance(nat, bool):
        raise ScenarioError(f"{where}.nat: true or false")
    return [Host(wname if count == 1 else f"{wname}-{k + 1}", w["region"], nat, float(offset),
                 None if start_at is False else start_at, _number(w, "throttle", where)) for k in range(count)]


def _event(raw: dict, i: int, regions: dict, workers: set[str], duration: float) -> Event:
    where = f"events[{i}]"
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: expected a table")
    unknown = set(raw) - {"at", "action", "worker", "for_s", "wait_for", "groups", "between", "delay_ms",
                          "jitter_ms", "loss", "rate_mbit"}
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {sorted(unknown)}")
    action = raw.get("action")
    if action not in ACTIONS:
        raise ScenarioError(f"{where}.action: one of {', '.join(ACTIONS)}; got {action!r}")
    at = _number(raw, "at", where)
    if at is None or at >= duration:
        raise ScenarioError(f"{where}.at: seconds within the run's duration_s ({duration:g})")
    worker = raw.get("worker")
    needs_worker = action in {"start", "kill", "restart", "stop", "freeze", "readdress"}
    if needs_worker != (worker is not None) or (worker is not None and worker not in workers):
        raise ScenarioError(f"{where}.worker: {'one of the workers' if needs_worker else 'not used by ' + action}"
                            f", got {worker!r}")
    for_s = _number(raw, "for_s", where, positive=True)
    wait_for = raw.get("wait_for")
    if wait_for is not None and (wait_for != "checkpoint" or worker is None):
        raise ScenarioError(f"{where}.wait_for: \"checkpoint\" (the event's worker has written one), got {wait_for!r}")
    if action == "freeze" and for_s is None:
        raise ScenarioError(f"{where}.for_s: how long the worker stays frozen")
    groups: tuple = ()
    if action == "partition":
        g = raw.get("groups")
        flat = [r for grp in g for r in grp] if isinstance(g, list) and all(isinstance(x, list) for x in g) else None
        if not flat or len(g) < 2 or any(r not in regions for r in flat) or len(set(flat)) != len(flat):
            raise ScenarioError(f"{where}.groups: two or more disjoint lists of regions")
        groups = tuple(tuple(grp) for grp in g)
    between, link = None, None
    if action == "link":
        b = raw.get("between")
        if not (isinstance(b, list) and len(b) == 2 and all(r in regions for r in b)):
            raise ScenarioError(f"{where}.between: two regions (the same one twice: inside it)")
        between = (b[0], b[1])
        link = _link({k: v for k, v in raw.items() if k in {"delay_ms", "jitter_ms", "loss", "rate_mbit"}}, where)
    return Event(at, action, worker, for_s, groups, between, link, wait_for)
