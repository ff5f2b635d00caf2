"""What a p2p daemon start costs, packed as hivemind's wheel ships it against unpacked.

    python scripts/bench_p2pd_start.py [--starts 10]

Starts the daemon with the flags hivemind gives a DHT node, packed and unpacked in turns: the CPU
it has used 1 s after its start (by then it listens and has set itself up; an idle daemon uses
next to nothing more), the time until its control socket appears, and its private memory (what
no other daemon shares), each as the median over ``--starts`` starts and as a ratio of the packed
daemon's in the same run. The packed daemon is hivemind's installed one; the unpacked one is made
in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from opendiloco.swarm.daemon.p2pd_binary import daemon_path, is_packed, unpack

HZ = os.sysconf("SC_CLK_TCK")
FLAGS = ["-autoRelay=0", "-autonat=1", "-b=0", "-connManager=1", "-idleTimeout=30s", "-natPortMap=1", "-relay=1",
         "-relayHopLimit=0", "-tls=1", "-persistentConnMaxMsgSize=4194304", "-dhtServer=1",
         "-hostAddrs=/ip4/127.0.0.1/tcp/0"]


def one_start(binary: Path, workdir: Path) -> tuple[float, float, float]:
    """(CPU seconds after 1 s, seconds to its control socket, private memory in MB) of one start."""
    sock = workdir / f"p2pd-{time.monotonic_ns()}.sock"
    start = time.monotonic()
    proc = subprocess.Popen([str(binary), *FLAGS, f"-listen=/unix{sock}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        ready = None
        while time.monotonic() - start < 1.0:
            if ready is None and sock.exists():
                ready = time.monotonic() - start
            time.sleep(0.002)
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / HZ
        private = sum(int(line.split()[1]) for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines()
                      if line.startswith(("Private_Clean:", "Private_Dirty:"))) / 1024
        return cpu, ready if ready is not None else float("nan"), private
    finally:
        proc.kill()
        proc.wait()
        sock.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=10)
    args = parser.parse_args()
    packed = daemon_path()
    if not is_packed(packed):
        print("no UPX-packed p2pd here to compare with", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        unpacked = work / "p2pd"
        print(unpack(packed, unpacked))
        runs: dict[str, list[tuple[float, float, float]]] = {"packed": [], "unpacked": []}
        for _ in range(args.starts):
            runs["packed"].append(one_start(packed, work))
            runs["unpacked"].append(one_start(unpacked, work))
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in runs.items()}
    print(f"{'daemon':10} {'CPU after 1 s':>14} {'to socket':>10} {'private memory':>15}")
    for k, (cpu, ready, rss) in med.items():
        print(f"{k:10} {cpu:12.3f} s {ready * 1000:7.0f} ms {rss:12.0f} MB")
    p, u = med["packed"], med["unpacked"]
    print(f"unpacked / packed: CPU {u[0] / p[0]:.2f}x, time to socket {u[1] / p[1]:.2f}x, "
          f"private memory {u[2] / p[2]:.2f}x (medians of {args.starts} starts each, in turns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
