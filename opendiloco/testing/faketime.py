"""A Python process whose wall clock is off, as an unsynchronised machine's is.

    python -m opendiloco.testing.faketime +2.5 -m opendiloco train ...     (or a script path)

``time.time`` and ``time.time_ns`` run ``offset`` seconds off (what hivemind's DHT times, the run's
records and the logs read), before the command runs; children forked from it (hivemind's DHT
process is a fork) inherit it, children started afresh do not. Not moved: ``datetime.now()``,
C code's own clock reads, and a reference to ``time.time`` held in a closure or a default argument
of a module imported before (a preforked child's). The monotonic clock is left alone, as a machine
with a wrong clock has it.

Debian's libfaketime cannot model that here: by default it moves the monotonic clock too, and a timed
wait on a lock (``threading.Event.wait(0.5)``) then never returns (the long world scenario's worker
with its clock 2.5 s ahead took part in 8 of 78 rounds and then hung in its state download); told
to leave the monotonic clock alone, it makes ``time.sleep`` fail with EINVAL.
"""

from __future__ import annotations

import runpy
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def clock_off(argv: Sequence[str], offset_s: float) -> list[str]:
    """``argv`` (a Python command: the interpreter, then ``-m module`` or a script, then its arguments)
    run with its wall clock ``offset_s`` seconds off."""
    return [argv[0], "-m", __name__, f"{offset_s:+g}", *argv[1:]]


def shift_wall_clock(offset_s: float) -> None:
    """Moves ``time.time`` and ``time.time_ns``, and every name a module already imported bound to them
    (hivemind's ``get_dht_time = time.time``: a process forked from one that imported it)."""
    real_time, real_time_ns = time.time, time.time_ns
    offset_ns = round(offset_s * 1e9)

    def shifted_time() -> float:
        return real_time() + offset_s

    def shifted_time_ns() -> int:
        return real_time_ns() + offset_ns

    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is real_time:
                setattr(module, name, shifted_time)
            elif value is real_time_ns:
                setattr(module, name, shifted_time_ns)


def main(args: list[str]) -> None:
    if len(args) < 2:
        raise SystemExit("usage: python -m opendiloco.testing.faketime OFFSET (-m MODULE | SCRIPT) [ARGS...]")
    shift_wall_clock(float(args[0]))
    if args[1] == "-m":
        sys.argv = [args[2], *args[3:]]
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args[1:]
        sys.path[0] = str(Path(args[1]).resolve().parent)
        runpy.run_path(args[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
