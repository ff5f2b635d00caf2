"""All-reduce: OpenDiLoCo's swarm round against torch.distributed gloo, same machine, same run.

For every peer count (``--peers``) this starts, as separate processes on 127.0.0.1,

* a bootstrap DHT node and N OpenDiLoCo peers, each with its own DHT node (and p2pd) joined
  through the bootstrap, each averaging a flat fp32 vector with ``SwarmCommunicator``
  (one swarm per wire codec, ``none`` = fp32 and ``fp16``, each its own run id);
* N ``torch.distributed`` gloo ranks that ``all_reduce`` tensors of the same sizes in fp32 and fp16.

What is timed
-------------
* **round**: what the optimizer waits for, ``communicator.start(flat).wait()``: matchmaking
  through the DHT, the streamed reduce-scatter / all-gather, and the members' digest
  confirmation. One round's time is ``max(leave) - max(enter)`` over the peers: from the moment
  the last peer is ready until the last peer holds the verified average.
* **transfer**: the data plane alone (an attempt's exchange and confirmation, after matchmaking,
  timed through the communicator's ``hooks``), same rule.
* gloo: ``dist.all_reduce`` after a ``dist.barrier()``, same rule.
* **extra memory**: per peer, the peak resident memory during a round minus the resident memory
  just before it (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), divided by the
  fp32 vector's bytes.

Each configuration runs one untimed warmup round and then ``--repeats`` timed rounds; the table
shows medians. Every peer checks its average against the exact mean, and all peers must report
the same digest (OpenDiLoCo promises bit-identical averages).

    .venv/bin/python scripts/bench_allreduce.py                 # 2 and 4 peers, 1M/10M/50M
    .venv/bin/python scripts/bench_allreduce.py --quick         # 1M and 10M only
    .venv/bin/python scripts/bench_allreduce.py --peers 4 --sizes 5e7 --codecs fp16
    .venv/bin/python scripts/bench_allreduce.py --peers 4 --sizes 5e7 --codecs fp16 --audit-chunks 0 4
                                   # the owners' audit off and on, each its own swarm, in one run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from opendiloco.testing.ports import free_port
from opendiloco.testing.proctree import ProcessGroup, command_line, descendants, spawn_bootstrap

ROOT = Path(__file__).resolve().parents[1]
CODECS = {"none": ("float32", 4), "fp16": ("float16", 2)}  # codec -> (gloo dtype, wire bytes per element)


def split_variant(variant: str) -> tuple[str, int | None]:
    """A swarm variant's codec and ``audit_chunks`` (None: the library's default): ``fp16``, ``fp16@audit0``."""
    codec, _, audit = variant.partition("@audit")
    return codec, int(audit) if audit else None


# -- process bookkeeping (by PID only) --------------------------------------------------------------

def status_bytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A memory field of /proc/PID/status (VmRSS, VmHWM...) in bytes; 0 for a process that is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Group(ProcessGroup):
    """Processes started for one measurement, with their peak memory; stopped by PID in ``stop``."""

    def __init__(self, tmp: Path):
        super().__init__(tmp, cwd=ROOT)
        self.peak_rss, self._sampling = 0, True
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while self._sampling:
            pids = self.track()
            self.peak_rss = max(self.peak_rss, sum(status_bytes(p) for p in pids))
            if mem_available() < 2**30:  # stop before the OOM killer picks a victim
                print("less than 1 GiB of memory left: stopping this measurement", file=sys.stderr, flush=True)
                for proc in list(self.procs):
                    if proc.poll() is None:
                        proc.kill()
            time.sleep(0.25)

    def stop(self) -> list[int]:
        self._sampling = False
        return super().stop()


# -- the OpenDiLoCo peer -------------------------------------------------------------------------------

def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _correctness(got, sent, factor: float, world: int, codec: str) -> tuple[bool, float]:
    """Whether ``got`` is the average of what the peers sent (this one ``sent``, ``factor`` x the base vector;
    peer r sends (r+1) x the base), within the codec's tolerance, and the largest error."""
    import torch

    expected = sent * ((world + 1) / 2 / factor)
    tol = dict(rtol=1e-5, atol=1e-6) if codec == "none" else dict(rtol=3e-3, atol=2e-3)
    return bool(torch.allclose(got, expected, **tol)), float((got - expected).abs().max())


def run_peer(args) -> int:
    import torch

    from opendiloco.comm.base import RoundKey
    from opendiloco.swarm.communicator import SwarmCommunicator
    from opendiloco.swarm.daemon.node import start_dht
    from opendiloco.swarm.hooks import RoundHooks
    from opendiloco.swarm.settings import SwarmSettings

    torch.set_num_threads(args.threads)

    class DataPlaneTimer(RoundHooks):
        """Records when this peer enters and leaves an attempt's exchange (after matchmaking), and the CPU
        seconds it and its p2p daemons spent in between."""

        def __init__(self):
            self.marks: list[tuple[float, float, float, float]] = []
            self._entered: tuple[float, float, float] | None = None

        async def before_exchange(self, group):
            self._entered = (time.time(), cpu_seconds(os.getpid()), sum(map(cpu_seconds, p2pd_pids)))

        def attempt_ended(self, group, error):
            if self._entered is not None:
                t0, my_cpu, p2pd_cpu = self._entered
                self.marks.append((t0, time.time(), cpu_seconds(os.getpid()) - my_cpu,
                                   sum(map(cpu_seconds, p2pd_pids)) - p2pd_cpu))
                self._entered = None

    peers = Path(args.peers_file).read_text().split()
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    p2pd_pids = [p for p in descendants(os.getpid()) if "p2pd" in command_line(p)]
    variant = args.codecs[0]  # one communicator per DHT node (see measure_swarm)
    codec, audit = split_variant(variant)
    audited = {} if audit is None else {"audit_chunks": audit}
    settings = SwarmSettings(run_id=f"bench-{codec}-{audit}", compression=codec, min_group_size=args.world, **audited,
                             matchmaking_timeout=300.0, allreduce_timeout=300.0, straggler_wait=60.0,
                             max_attempts=1, heartbeat_interval=2.0, record_ttl=60.0, verify_timeout=60.0)
    comm = None
    out = open(args.out, "w")
    try:
        timer = DataPlaneTimer()
        comm = SwarmCommunicator(dht, settings, own_dht=False)
        comm.hooks = timer
        step, factor = 0, float(args.rank + 1)
        for size in args.sizes:
            gen = torch.Generator().manual_seed(size)
            vec = torch.randn(size, generator=gen).mul_(factor)  # peer r sends (r+1) * base
            averaged = torch.zeros(size)  # reused, as the optimizer reuses its result buffer
            for rnd in range(args.warmup + args.repeats):
                import gc

                gc.collect()
                before = status_bytes()
                peak_ok = _reset_peak_rss()
                t0 = time.time()
                result = comm.start(vec, weight=1.0, key=RoundKey(step), out=averaged).wait()
                t1 = time.time()
                peak = status_bytes(field="VmHWM") if peak_ok else 0
                step += 1
                enter, leave, py_cpu, p2pd_cpu = timer.marks[-1]
                got, digest, group = result.flat, result.extra.get("digest"), len(result.peers)
                # correctness, outside the timed window
                ok, err = _correctness(got, vec, factor, args.world, codec) if rnd == 0 else (None, None)
                del got, result
                out.write(json.dumps({
                    "rank": args.rank, "size": size, "codec": variant, "round": rnd, "warmup": rnd < args.warmup,
                    "enter": enter, "leave": leave, "average_start": t0, "average_end": t1,
                    "py_cpu": py_cpu, "p2pd_cpu": p2pd_cpu, "ok": ok, "max_err": err,
                    "digest": digest, "group": group,
                    "extra_mem": (peak - before) / (4 * size) if peak_ok else None}) + "\n")
                out.flush()
            del vec, averaged
    finally:
        if comm is not None:
            comm.close()
        dht.shutdown()
        out.close()
    return 0


# -- the gloo rank -------------------------------------------------------------------------------------

def run_gloo(args) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=300))
    out = open(args.out, "w")
    try:
        factor = float(args.rank + 1)
        for size in args.sizes:
            base = torch.randn(size, generator=torch.Generator().manual_seed(size)).mul_(factor)
            for codec in args.codecs:
                dtype = getattr(torch, CODECS[codec][0])
                vec = base.to(dtype)
                for rnd in range(args.warmup + args.repeats):
                    x = vec.clone()
                    dist.barrier()
                    t0 = time.time()
                    dist.all_reduce(x)
                    t1 = time.time()
                    ok = None
                    if rnd == 0:
                        expected = (base * ((args.world + 1) / 2 / factor)).to(dtype)
                        tol = dict(rtol=1e-5, atol=1e-5) if codec == "none" else dict(rtol=5e-3, atol=1e-2)
                        ok = bool(torch.allclose((x / args.world).float(), expected.float(), **tol))
                        del expected
                    del x
                    out.write(json.dumps({"rank": args.rank, "size": size, "codec": codec, "round": rnd,
                                          "warmup": rnd < args.warmup, "enter": t0, "leave": t1, "ok": ok}) + "\n")
                    out.flush()
                del vec
            del base
    finally:
        out.close()
        dist.destroy_process_group()
    return 0


# -- the orchestrator ------------------------------------------------------------------------------------

def _child_args(args, role: str, rank: int, world: int, out: Path, extra: list[str]) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--rank", str(rank), "--world", str(world),
           "--out", str(out), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--sizes", *map(str, args.sizes), "--codecs", *args.codecs]
    return cmd + extra


def _read(paths: list[Path]) -> list[dict]:
    rows = []
    for p in paths:
        rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return rows


def _timeout(args, world: int, sizes: list[int]) -> float:
    rounds = (args.warmup + args.repeats) * len(args.codecs)
    return 120 + rounds * sum(sizes) / 1e6 * world * 0.3


def measure_gloo(args, world: int, sizes: list[int], tmp: Path) -> list[dict]:
    group = Group(tmp)
    outs = [tmp / f"gloo{world}-{r}.jsonl" for r in range(world)]
    port = free_port()
    try:
        a = argparse.Namespace(**{**vars(args), "sizes": sizes, "codecs": list(CODECS)})  # both dtypes, always
        procs = [group.spawn(_child_args(a, "gloo", r, world, outs[r], ["--port", str(port)]), f"gloo{world}-{r}")
                 for r in range(world)]
        group.wait(procs, _timeout(args, world, sizes))
    finally:
        leaked = group.stop()
        if leaked:
            print(f"warning: killed {len(leaked)} leftover gloo processes: {leaked}", file=sys.stderr)
    return _read(outs)


def measure_swarm(args, world: int, sizes: list[int], codec: str, tmp: Path) -> tuple[list[dict], int]:
    """A fresh swarm per codec: two SwarmCommunicators on one DHT node would share its single
    p2p replica, which is bound to the first communicator's event loop (the second one stalled)."""
    group = Group(tmp)
    peers_file = tmp / f"peers{world}-{codec}.txt"
    outs = [tmp / f"swarm{world}-{codec}-{r}.jsonl" for r in range(world)]
    try:
        spawn_bootstrap(group, peers_file, f"bootstrap{world}-{codec}")
        a = argparse.Namespace(**{**vars(args), "sizes": sizes, "codecs": [codec]})
        procs = [group.spawn(_child_args(a, "peer", r, world, outs[r], ["--peers-file", str(peers_file)]),
                             f"swarm{world}-{codec}-{r}") for r in range(world)]
        group.wait(procs, _timeout(a, world, sizes))
    finally:
        leaked = group.stop()
        if leaked:
            print(f"warning: killed {len(leaked)} leftover swarm processes: {leaked}", file=sys.stderr)
    return _read(outs), group.peak_rss


def summarize(rows: list[dict], world: int, size: int, codec: str) -> dict | None:
    mine = [r for r in rows if r["size"] == size and r["codec"] == codec]
    if not mine:
        return None
    rounds = sorted({r["round"] for r in mine if not r["warmup"]})
    spans, whole, py_cpu, p2pd_cpu, extra_mem = [], [], [], [], []
    for rnd in rounds:
        rs = [r for r in mine if r["round"] == rnd]
        if len(rs) != world:
            raise RuntimeError(f"round {rnd} of {size}/{codec}: {len(rs)} of {world} peers reported")
        spans.append(max(r["leave"] for r in rs) - max(r["enter"] for r in rs))
        if "average_start" in rs[0]:
            whole.append(max(r["average_end"] for r in rs) - max(r["average_start"] for r in rs))
            py_cpu += [r["py_cpu"] for r in rs]
            p2pd_cpu += [r["p2pd_cpu"] for r in rs]
            extra_mem += [r["extra_mem"] for r in rs if r.get("extra_mem") is not None]
    checks = [r["ok"] for r in mine if r["ok"] is not None]
    for rnd in {r["round"] for r in mine if "digest" in r}:
        rs = [r for r in mine if r["round"] == rnd]
        if len({r["digest"] for r in rs}) != 1 or any(r["group"] != world for r in rs):
            checks.append(False)  # peers must hold bit-identical averages from a full group
    out = {"seconds": statistics.median(spans), "all": spans, "ok": all(checks) and len(checks) == world}
    if whole:
        out.update(round=statistics.median(whole), py_cpu=statistics.median(py_cpu),
                   p2pd_cpu=statistics.median(p2pd_cpu),
                   max_err=max(r["max_err"] for r in mine if r["max_err"] is not None),
                   extra_mem=max(extra_mem) if extra_mem else None)
    return out


def human(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k"


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["main", "peer", "gloo"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--peers-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peers", type=int, nargs="+", default=[2, 4], help="peer counts (default: 2 4)")
    p.add_argument("--sizes", type=float, nargs="+", default=None,
                   help="vector sizes in fp32 parameters, e.g. 1e6 1e7 5e7 (default: 1M 10M 50M)")
    p.add_argument("--quick", action="store_true", help="only 1M and 10M parameters")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), help=f"wire codecs, of {', '.join(CODECS)}")
    p.add_argument("--audit-chunks", type=int, nargs="+", default=None,
                   help="the swarm's audit_chunks, one swarm each (default: the library's default)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per configuration")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per configuration (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (2 cores here)")
    p.add_argument("--json", default=None, help="also write all results to this JSON file")
    args = p.parse_args()
    unknown = [c for c in args.codecs if split_variant(c)[0] not in CODECS]
    if unknown:
        p.error(f"unknown codec(s) {unknown}: choose from {', '.join(CODECS)}")
    if args.sizes is None:
        args.sizes = [1_000_000, 10_000_000] if args.quick else [1_000_000, 10_000_000, 50_000_000]
    args.sizes = sorted(int(s) for s in args.sizes)
    if args.repeats < 3 and args.role == "main":
        print("note: fewer than 3 repeats; medians are noisy", file=sys.stderr)
    return args


def _measure(args) -> list[dict]:
    """Every configuration of ``args``: gloo, then each swarm variant, per peer count (those the memory allows)."""
    results = []
    variants = [c if args.audit_chunks is None else f"{c}@audit{a}" for c in args.codecs
                for a in (args.audit_chunks or [None])]
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as tmp_dir:
        tmp = Path(tmp_dir)
        for world in args.peers:
            # Measured (2 peers, 50M fp32): a peer's python process peaks at ~0.35 GiB + ~12x the fp32
            # vector (input, flat copy, packed parts, chunks, received payloads, fp64 accumulator,
            # decoded shards, result), its DHT process and p2pd add ~0.3 GiB: budget 0.7 GiB + 14x.
            sizes = []
            for size in args.sizes:
                need = world * (0.7 * 2**30 + 14 * 4 * size)
                if need > 0.8 * mem_available():
                    print(f"skipping {world} peers x {human(size)}: needs ~{need / 2**30:.1f} GiB, "
                          f"{mem_available() / 2**30:.1f} GiB available", flush=True)
                else:
                    sizes.append(size)
            if not sizes:
                continue
            t0 = time.monotonic()
            gloo = measure_gloo(args, world, sizes, tmp)
            print(f"# gloo, {world} processes: done in {time.monotonic() - t0:.0f}s; "
                  f"load average {os.getloadavg()[0]:.2f}", flush=True)
            swarm, peaks = [], {}
            for codec in variants:
                t0 = time.monotonic()
                rows, peaks[codec] = measure_swarm(args, world, sizes, codec, tmp)
                swarm += rows
                print(f"# opendiloco, {world} peers, {codec}: done in {time.monotonic() - t0:.0f}s; peak RSS of the "
                      f"bootstrap + {world} peers (python + DHT + p2pd) {peaks[codec] / 2**30:.2f} GiB; "
                      f"load average {os.getloadavg()[0]:.2f}", flush=True)
            for size in sizes:
                for codec in variants:
                    base = split_variant(codec)[0]
                    s, g = summarize(swarm, world, size, codec), summarize(gloo, world, size, base)
                    wire = 2 * (world - 1) / world * size * CODECS[base][1]
                    g32 = summarize(gloo, world, size, "none")
                    results.append({"peers": world, "params": size, "codec": codec, "opendiloco": s, "gloo": g,
                                    "gloo_fp32": g32, "wire_bytes_per_peer": wire, "peak_rss_group": peaks[codec]})
    return results


def _print_table(results: list[dict]) -> None:
    header = ("| peers | params | codec | round s (start..wait) | transfer s | gloo s | round / gloo "
              "| transfer / gloo | round / gloo fp32 | MB/s/peer (round) | py CPU s | p2pd CPU s "
              "| extra memory / vector | ok |")
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in results:
        s, g, wire = r["opendiloco"], r["gloo"], r["wire_bytes_per_peer"]
        g32 = r.get("gloo_fp32")
        mem = f"{s['extra_mem']:.2f}x" if s.get("extra_mem") is not None else "n/a"
        print(f"| {r['peers']} | {human(r['params'])} | {r['codec']} | {s['round']:.3f} | {s['seconds']:.3f} "
              f"| {g['seconds']:.3f} | {s['round'] / g['seconds']:.2f}x | {s['seconds'] / g['seconds']:.2f}x "
              f"| {s['round'] / g32['seconds']:.2f}x | {wire / s['round'] / 1e6:.0f} "
              f"| {s['py_cpu']:.2f} | {s['p2pd_cpu']:.2f} | {mem} | {'yes' if s['ok'] and g['ok'] else 'NO'} |")
    print("\nround: median over timed rounds of max(leave) - max(enter) over peers of start(...).wait() "
          "(matchmaking + transfer + digest confirmation); transfer: the data plane alone (exchange + "
          "confirmation, after matchmaking); gloo: all_reduce of the same vector in the codec's dtype "
          "(\"gloo fp32\": in fp32).")
    print("MB/s/peer: 2(N-1)/N x encoded vector bytes sent by each peer / round seconds. py/p2pd CPU: per peer per "
          "data plane. extra memory: peak RSS during a round minus RSS before it, / fp32 vector bytes (worst peer).")


def _print_audit_cost(results: list[dict]) -> None:
    """Each audited swarm against the one without the audit, measured in the same run."""
    off = {(r["peers"], r["params"], split_variant(r["codec"])[0]): r["opendiloco"] for r in results
           if split_variant(r["codec"])[1] == 0}
    for r in results:
        base = off.get((r["peers"], r["params"], split_variant(r["codec"])[0]))
        if base is not None and split_variant(r["codec"])[1]:
            mine = r["opendiloco"]
            print(f"{r['peers']} peers, {human(r['params'])}, {r['codec']}: round {mine['round'] / base['round']:.2f}x "
                  f"and py CPU {mine['py_cpu'] / base['py_cpu']:.2f}x the swarm without the audit")


def main() -> int:
    args = _arguments()
    if args.role == "peer":
        return run_peer(args)
    if args.role == "gloo":
        return run_gloo(args)

    import hivemind
    import torch

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{mem_available() / 2**30:.1f} GiB available; torch {torch.__version__}, hivemind {hivemind.__version__}; "
          f"127.0.0.1; {args.threads} torch thread(s) per process", flush=True)
    results = _measure(args)
    _print_table(results)
    _print_audit_cost(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    bad = [r for r in results if not (r["opendiloco"]["ok"] and r["gloo"]["ok"])]
    if bad:
        print(f"\nWARNING: {len(bad)} configuration(s) failed the correctness check", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
