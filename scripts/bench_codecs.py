"""Codec speed: encode, decode and both, in seconds per 10M values, each format against fp16.

    .venv/bin/python scripts/bench_codecs.py [--repeats 15] [--threads N] [--module PATH] [--busy N]

Encode is ``to_bytes`` (what a worker sends), decode is ``decode_into`` (what a receiver does with
a payload). The formats take turns within each repeat, so that load from other jobs falls on all
of them alike; the figures are medians, and the ratios to fp16 are taken within the same run.
``--module`` times another copy of ``compression.py`` (say the previous commit's, from
``git show HEAD~1:opendiloco/comm/compression.py``) in the same way. ``--busy N`` runs N
busy-looping processes beside the measurement: a machine whose cores are all taken.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

NAMES = ["fp16", "int8", "int4", "e2m1", "e3m0"]


def load_codecs(module: Path | None):
    """name -> codec: the package's registry, or the dense formats of a copy of ``compression.py``."""
    if module is None:
        from opendiloco.comm.formats import get_codec
        return get_codec
    # a copy outside the package: its relative imports point into the package
    text = module.read_text().replace("from ..", "from opendiloco.").replace("from .", "from opendiloco.comm.")
    spec = importlib.util.spec_from_loader("compression_under_test", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(text, str(module), "exec"), mod.__dict__)  # noqa: S102 - a local file the user names
    makers = {"fp16": mod.Float16Compression, "int8": mod.int8, "int4": mod.int4, "e2m1": mod.e2m1, "e3m0": mod.e3m0}
    return lambda name: makers[name]()


def measure(make, names: list[str], numel: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of encode, decode, encode + decode per format, scaled to 10M values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g) * torch.logspace(-4, -1, numel)  # pseudo-gradient-like magnitudes
    out = torch.empty_like(x)
    codecs = {n: make(n) for n in names}
    times: dict[str, dict[str, list[float]]] = {n: {"encode": [], "decode": [], "both": []} for n in names}
    for r in range(repeats + 1):  # the first round warms up
        for name, codec in codecs.items():
            t0 = time.perf_counter()
            payload = codec.to_bytes(x)
            t1 = time.perf_counter()
            codec.decode_into(payload, out)
            t2 = time.perf_counter()
            if r:
                times[name]["encode"].append(t1 - t0)
                times[name]["decode"].append(t2 - t1)
                times[name]["both"].append(t2 - t0)
    per10m = 1e7 / numel
    return {n: {k: statistics.median(v) * per10m for k, v in t.items()} for n, t in times.items()}


def table(result: dict[str, dict[str, float]]) -> str:
    base = result["fp16"]
    lines = ["| format | encode | decode | encode + decode | encode vs fp16 | decode vs fp16 | both vs fp16 |",
             "|---|---|---|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name} | {r['encode'] * 1e3:.1f} ms | {r['decode'] * 1e3:.1f} ms | {r['both'] * 1e3:.1f} ms "
                     f"| {r['encode'] / base['encode']:.2f}x | {r['decode'] / base['decode']:.2f}x "
                     f"| {r['both'] / base['both']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=10_000_000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--module", type=Path, default=None, help="time this copy of compression.py instead")
    p.add_argument("--codecs", default=",".join(NAMES), help="fp16 (the baseline) first")
    p.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the measurement")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.codecs.split(",")
    if "fp16" not in names:
        names.insert(0, "fp16")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        result = measure(load_codecs(args.module), names, args.numel, args.repeats)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    print(f"{args.module or 'opendiloco.comm.compression'}: {args.numel:,} values, median of {args.repeats}, "
          f"{torch.get_num_threads()} threads, {args.busy} busy processes; seconds scaled to 10M values")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
