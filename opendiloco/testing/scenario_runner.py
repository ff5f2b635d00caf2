"""Plays a scenario: the real ``opendiloco`` CLI, one network namespace per host, faults on a schedule.

Every worker is ``opendiloco train`` (and the bootstrap ``opendiloco dht``) started inside its
host's namespace of a ``World``, with the scenario's training config, a closed run's secret
and, for a host whose clock is off, ``faketime.py`` (its wall clock moved, in Python). A restarted
worker gets a new peer id, as it does with the default config. The runner writes what it did to
``events.jsonl`` (launches, exits, faults, with the runner's own clock) beside the workers' run
dirs; ``scenario_report.py`` reads both.

Bounded and tidy: the run ends at ``duration_s``, or earlier once it has settled
(``settle_rounds``); the workers are asked to stop, then killed by PID; and the namespaces, the
link emulator and every process started here are gone afterwards, also when the runner itself
is interrupted (SIGINT/SIGTERM).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..train.metrics import read_metrics
from .faketime import clock_off
from .proctree import ProcessGroup, alive, children_table, descendants
from .scenario import Event, Scenario
from .world import LinkSpec, World

PORT = 31337
ROOT = Path(__file__).resolve().parents[2]


def _spec(link) -> LinkSpec:
    return LinkSpec(delay_ms=link.delay_ms, jitter_ms=link.jitter_ms, loss=link.loss, rate_mbit=link.rate_mbit)


@dataclass
class Instance:
    """One launch of a worker (a restart is a new instance)."""

    proc: subprocess.Popen
    launched: float
    resumed: bool
    known: set[int] = field(default_factory=set)
    """Descendants seen so far (the DHT process, the p2p daemon): ended by PID with their worker."""


class ScenarioRunner:
    def __init__(self, scenario: Scenario, out_dir: str | Path, *, prefix: str | None = None,
                 python: str = sys.executable, stop_grace: float = 60.0, say=None):
        self.scenario, self.out = scenario, Path(out_dir)
        self.prefix = prefix or f"odw{os.getpid() % 100000}"
        self.python, self.stop_grace = python, stop_grace
        self.say = say or (lambda msg: print(msg, flush=True))
        self.instances: dict[str, list[Instance]] = {w.name: [] for w in scenario.workers}
        self.bootstrap: Instance | None = None
        self.world: World | None = None
        self.frozen: set[str] = set()
        self._events_file = None
        self._t0 = 0.0
        self._lock = threading.Lock()

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> Path:
        """Plays the scenario to its end; returns the output dir (events.jsonl, workers/, logs/)."""
        s = self.scenario
        if self.out.exists():
            shutil.rmtree(self.out)
        (self.out / "logs").mkdir(parents=True)
        (self.out / "workers").mkdir()
        (self.out / "secret").write_text(os.urandom(32).hex() + "\n")
        os.chmod(self.out / "secret", 0o600)
        self._events_file = (self.out / "events.jsonl").open("a")
        previous = {sig: signal.signal(sig, self._interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._build_world()
            self._t0 = time.time()
            self._record("begin", scenario=s.name, duration_s=s.duration_s, prefix=self.prefix)
            self._start_bootstrap()
            self._play()
            self._record("end")
        finally:
            try:
                self._stop_everything()
            finally:
                if self.world is not None:
                    self.world.teardown()
                self._events_file.close()
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        return self.out

    def _interrupted(self, signum, frame):
        raise KeyboardInterrupt(f"runner got {signal.Signals(signum).name}")

    def _build_world(self) -> None:
        s = self.scenario
        links = {(r, r): _spec(link) for r, link in s.regions.items()}
        names = list(s.regions)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                links[(a, b)] = _spec(s.link_between(a, b))
        self.world = World(links, prefix=self.prefix)
        self.world.add_host("bootstrap", s.bootstrap_region)
        for w in s.workers:
            self.world.add_host(w.name, w.region, nat=w.nat)
        self.world.setup()
        hosts = {"bootstrap": {"region": s.bootstrap_region, "ip": self.world.ip_of("bootstrap"), "nat": False}}
        for w in s.workers:
            hosts[w.name] = {"region": w.region, "ip": self.world.ip_of(w.name), "nat": w.nat,
                             "clock_offset_s": w.clock_offset_s}
        (self.out / "world.json").write_text(json.dumps({
            "hosts": hosts, "links": {f"{a}|{b}": vars(v) for (a, b), v in links.items()}}, indent=1))

    def _play(self) -> None:
        s = self.scenario
        agenda: list[tuple[float, int, Event]] = []
        for w in s.workers:
            if w.start_at is not None:
                agenda.append((w.start_at, 0, Event(w.start_at, "start", w.name)))
        for e in s.events:
            agenda.append((e.at, 1, e))
            if e.for_s is not None and e.action in ("freeze", "link", "partition"):
                undo = {"freeze": "thaw", "link": "restore_link", "partition": "heal"}[e.action]
                agenda.append((e.at + e.for_s, 2, Event(e.at + e.for_s, undo, e.worker, between=e.between)))
        agenda.sort(key=lambda x: (x[0], x[1]))
        held = 0.0  # how long events waiting for a condition held the schedule back
        for at, _, event in agenda:
            if at + held >= s.duration_s:
                continue
            self._sleep_until(at + held)
            if event.wait_for == "checkpoint":
                since = self._now()
                self._wait_until(lambda w=event.worker: self._has_checkpoint(w), s.duration_s)
                waited = self._now() - since
                if waited >= 1.0:
                    held += waited
                    self._record("held", action=event.action, worker=event.worker, for_s=round(waited, 2))
                if self._now() >= s.duration_s:
                    continue
            try:
                self._apply(event)
            except Exception as e:  # a fault that could not be applied is recorded, the run goes on
                self._record("event_failed", action=event.action, worker=event.worker, error=str(e))
                self.say(f"[{self._now():6.1f}s] {event.action} {event.worker or ''} failed: {e}")
        if s.settle_rounds:
            last_event = time.time()
            if self._wait_until(lambda: self._settled(last_event, s.settle_rounds), s.duration_s):
                self._record("settled", rounds=s.settle_rounds)
                self.say(f"[{self._now():6.1f}s] settled: every running worker contributed to "
                         f"{s.settle_rounds} round(s) since the last event")
                return
        self._sleep_until(s.duration_s)

    def _wait_until(self, condition, bound: float) -> bool:
        """Polls ``condition`` each second until it holds (True) or the run's clock reaches ``bound``."""
        while self._now() < bound:
            self._track()
            if condition():
                return True
            time.sleep(min(1.0, max(0.0, bound - self._now())))
        return False

    def _has_checkpoint(self, name: str) -> bool:
        return any((self.out / "workers" / name / "checkpoints").glob("step-*.pt"))

    def _settled(self, since: float, rounds: int) -> bool:
        """Every running worker (not frozen) applied ``rounds`` rounds with its own steps in them since
        ``since`` and since its launch, by the records it wrote (its clock corrected by its offset)."""
        running = [(n, i) for n, i in ((n, self._current(n)) for n in self.instances)
                   if i is not None and i.proc.poll() is None and n not in self.frozen]
        if not running:
            return False
        for name, inst in running:
            path = self.out / "workers" / name / "metrics.jsonl"
            offset = self.scenario.worker(name).clock_offset_s
            after = max(since, inst.launched)
            recs = read_metrics(path) if path.exists() else []
            done = sum(1 for r in recs if r.get("event") == "outer_step" and r.get("ok")
                       and (r.get("contributed_steps") or 0) > 0 and r.get("time", 0.0) - offset >= after)
            if done < rounds:
                return False
        return True

    def _sleep_until(self, at: float) -> None:
        while True:
            left = at - self._now()
            if left <= 0:
                return
            self._track()
            time.sleep(min(left, 1.0))

    def _now(self) -> float:
        return time.time() - self._t0

    def _record(self, kind: str, **fields) -> None:
        rec = {"kind": kind, "time": time.time(), "t": round(self._now(), 3), **fields}
        self._events_file.write(json.dumps(rec) + "\n")
        self._events_file.flush()

    # -- events ----------------------------------------------------------------------------------
    def _apply(self, e: Event) -> None:
        w = self.world
        self.say(f"[{self._now():6.1f}s] {e.action} {e.worker or ''}{' ' + str(e.groups) if e.groups else ''}")
        if e.action == "start":
            self._launch(e.worker, resume=False)
        elif e.action == "restart":
            self._end_instance(e.worker, signal.SIGKILL)  # if it still runs (stopped or frozen)
            self._launch(e.worker, resume=True)
        elif e.action == "kill":
            self._end_instance(e.worker, signal.SIGKILL)
            self._record("kill", worker=e.worker)
        elif e.action == "stop":
            inst = self._current(e.worker)
            if inst is not None and inst.proc.poll() is None:
                inst.proc.send_signal(signal.SIGTERM)
            self._record("stop", worker=e.worker)
        elif e.action == "freeze":
            self._signal_tree(e.worker, signal.SIGSTOP)
            self.frozen.add(e.worker)
            self._record("freeze", worker=e.worker, for_s=e.for_s)
        elif e.action == "thaw":
            self._signal_tree(e.worker, signal.SIGCONT)
            self.frozen.discard(e.worker)
            self._record("thaw", worker=e.worker)
        elif e.action == "readdress":
            old = w.ip_of(e.worker)
            new = w.readdress(e.worker)
            self._record("readdress", worker=e.worker, old=old, new=new)
        elif e.action == "partition":
            w.partition(*[set(g) for g in e.groups])
            self._record("partition", groups=[list(g) for g in e.groups])
        elif e.action == "heal":
            w.heal()
            self._record("heal")
        elif e.action == "link":
            a, b = e.between
            w.set_link(a, b, _spec(e.link))
            self._record("link", between=[a, b], **vars(e.link))
        elif e.action == "restore_link":
            a, b = e.between
            w.set_link(a, b, _spec(self.scenario.link_between(a, b)))
            self._record("restore_link", between=[a, b])
        elif e.action == "kill_bootstrap":
            if self.bootstrap is not None:
                self._kill_instance(self.bootstrap, signal.SIGKILL)
            self._record("kill_bootstrap")
        elif e.action == "restart_bootstrap":
            self._start_bootstrap()
        else:  # pragma: no cover - scenario.py validates actions
            raise ValueError(e.action)

    # -- processes -------------------------------------------------------------------------------
    def _ns_cmd(self, host: str, argv: list[str], clock_offset: float = 0.0) -> list[str]:
        cmd = clock_off(argv, clock_offset) if clock_offset else argv
        return self.world.exec(host, *cmd)

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        path = self.out / "logs" / f"{name}.log"
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        server = ProcessGroup.prefork  # in the test suite: forked from a pre-imported interpreter
        proc = server.spawn(argv, path, ROOT, full_env, new_session=True) if server is not None else None
        if proc is not None:
            return proc
        with path.open("ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=full_env,
                                    start_new_session=True)

    def _start_bootstrap(self) -> None:
        ip = self.world.ip_of("bootstrap")
        addrs = self.out / "bootstrap.addrs"
        addrs.unlink(missing_ok=True)
        argv = [self.python, "-m", "opendiloco", "dht", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}",
                "--announce-maddrs", f"/ip4/{ip}/tcp/{PORT}", "--identity-path", str(self.out / "bootstrap.key"),
                "--addrs-file", str(addrs)]
        proc = self._spawn("bootstrap", self._ns_cmd("bootstrap", argv))
        self.bootstrap = Instance(proc, time.time(), resumed=False)
        deadline = time.monotonic() + 120
        while not (addrs.exists() and addrs.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap did not start: {(self.out / 'logs' / 'bootstrap.log').read_text()}")
            time.sleep(0.1)
        self._record("bootstrap", ip=ip, pid=proc.pid)

    def initial_peers(self) -> list[str]:
        """The bootstrap's address and every live worker's: a joiner needs one that answers."""
        peers = [f"/ip4/{self.world.ip_of('bootstrap')}/tcp/{PORT}/p2p/{self._bootstrap_id()}"]
        for name, insts in self.instances.items():
            host = self.scenario.worker(name)
            if insts and insts[-1].proc.poll() is None and not host.nat:
                pid_file = self.out / "workers" / name / "peer_addrs.txt"
                ids = [a.rsplit("/p2p/", 1)[-1] for a in pid_file.read_text().split()] if pid_file.exists() else []
                if ids:
                    peers.append(f"/ip4/{self.world.ip_of(name)}/tcp/{PORT}/p2p/{ids[0]}")
        return peers

    def _bootstrap_id(self) -> str:
        return (self.out / "bootstrap.addrs").read_text().split()[0].rsplit("/p2p/", 1)[-1]

    def worker_argv(self, name: str, resume: bool) -> list[str]:
        s, host = self.scenario, self.scenario.worker(name)
        run_dir = self.out / "workers" / name
        argv = [self.python, "-m", "opendiloco", "train", "--config", str(ROOT / s.config),
                "--run.dir", str(run_dir), "--run.worker", name, "--run.progress", "false",
                "--train.throttle", str(host.throttle if host.throttle is not None else s.throttle),
                "--swarm.host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}",
                "--swarm.client-mode", "true" if host.nat else "false"]
        for key, value in s.overrides.items():
            section, _, k = key.partition(".")
            text = str(value).lower() if isinstance(value, bool) else str(value)
            argv += [f"--{section}.{k.replace('_', '-')}", text]
        argv += ["--swarm.initial-peers", *self.initial_peers()]
        if resume:
            argv.append("--resume")
        return argv

    def _launch(self, name: str, resume: bool) -> None:
        host = self.scenario.worker(name)
        # A first start with checkpoints already there (a restart of a worker that never wrote one is
        # a fresh start): --resume only where there is something to resume.
        has_ckpt = any((self.out / "workers" / name).glob("checkpoints/*")) or any(
            (self.out / "workers" / name).glob("*.pt"))
        resume = resume and has_ckpt
        argv = self._ns_cmd(name, self.worker_argv(name, resume), host.clock_offset_s)
        proc = self._spawn(name, argv, env={"OPENDILOCO_RUN_SECRET_FILE": str(self.out / "secret")})
        with self._lock:
            self.instances[name].append(Instance(proc, time.time(), resume))
        self._record("launch", worker=name, pid=proc.pid, resumed=resume, instance=len(self.instances[name]),
                     ip=self.world.ip_of(name))

    def _current(self, name: str) -> Instance | None:
        insts = self.instances.get(name) or []
        return insts[-1] if insts else None

    def _track(self) -> None:
        """Remembers every descendant of the running processes, so that they can be ended by PID."""
        table = children_table()
        with self._lock:
            everything = [i for insts in self.instances.values() for i in insts]
        if self.bootstrap is not None:
            everything.append(self.bootstrap)
        for inst in everything:
            if inst.proc.poll() is None:
                inst.known.update(descendants(inst.proc.pid, table))
            elif not getattr(inst, "exit_recorded", False):
                inst.exit_recorded = True
                name = next((n for n, insts in self.instances.items() if inst in insts), "bootstrap")
                self._record("exit", worker=name, pid=inst.proc.pid, code=inst.proc.returncode)

    def _signal_tree(self, name: str, sig: int) -> None:
        inst = self._current(name)
        if inst is None or inst.proc.poll() is not None:
            return
        self._track()
        for pid in [inst.proc.pid, *descendants(inst.proc.pid)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _kill_instance(self, inst: Instance, sig: int) -> None:
        table = children_table()
        pids = {inst.proc.pid, *descendants(inst.proc.pid, table), *inst.known}
        for pid in pids:
            if alive(pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if sig == signal.SIGKILL:
            try:
                inst.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def _end_instance(self, name: str, sig: int) -> None:
        inst = self._current(name)
        if inst is not None and inst.proc.poll() is None:
            self.frozen.discard(name)
            self._kill_instance(inst, sig)
        self._track()

    def _stop_everything(self) -> None:
        """Workers first (thawed, then SIGTERM: they checkpoint and leave), then the bootstrap; by PID."""
        self._track()
        running = [(n, i) for n, insts in self.instances.items() for i in insts if i.proc.poll() is None]
        for name, inst in running:
            if name in self.frozen:
                self._signal_tree(name, signal.SIGCONT)
            inst.proc.send_signal(signal.SIGTERM)
        self._record("stopping", workers=[n for n, _ in running])
        deadline = time.monotonic() + self.stop_grace
        for name, inst in running:
            try:
                inst.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._record("stop_timeout", worker=name)
                self._kill_instance(inst, signal.SIGKILL)
        self._track()
        if self.bootstrap is not None and self.bootstrap.proc.poll() is None:
            self.bootstrap.proc.send_signal(signal.SIGTERM)
            try:
                self.bootstrap.proc.wait(15)
            except subprocess.TimeoutExpired:
                self._kill_instance(self.bootstrap, signal.SIGKILL)
        # Whatever is left of what we started (a daemon that outlived its worker) is ended by PID.
        everything = [i for insts in self.instances.values() for i in insts]
        if self.bootstrap is not None:
            everything.append(self.bootstrap)
        leaked = sorted(p for i in everything for p in i.known if alive(p))
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._track()
        self._record("stopped", leaked=leaked)
