"""An asyncio event loop under virtual time: its clock moves only when nothing is ready to run, and then
jumps straight to the next timer. A wait of 60 s (``asyncio.sleep``, ``asyncio.wait_for``, ``loop.time()``
deadlines) takes no wall time; everything else runs as on any loop, in the same order.

Only code that reads time through the loop lives in virtual time: the round's code in ``comm/`` does
(docs/architecture.md). Real I/O still works (it is polled without blocking before the clock jumps); a
loop with no timer left and nothing ready blocks on it as usual.

Why not ``looptime`` (the PyPI package that fast-forwards a loop's time, 0.9): measured on the same
simulation (``testing/sim.py``, 8 workers, one of them dying in round 1; 2-core machine, wall time of
``Swarm.run`` alone, 5 runs each), this loop and ``looptime.new_event_loop()`` took, min / median:
3 rounds (108.5 s virtual): 0.080 / 0.092 s here, 0.094 / 0.102 s with looptime; 10 rounds (343 s
virtual): 0.236 / 0.249 s here, 0.247 / 0.347 s with looptime; the deaths closing their streams instead
(100.5 s virtual): 0.106 / 0.111 s here, 0.101 / 0.120 s with looptime. The same virtual times and
outcomes both ways, no faster with the package (which also idles 42 loop turns before each jump), so the
tests keep these few lines and need no extra dependency.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; where nothing is ready, moves the loop's clock by the wait it was asked for."""

    def __init__(self, loop: VirtualTimeLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only real I/O (another thread) can wake the loop
            return super().select(None)
        self._loop.advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``loop.time()`` starts at 0 and moves only by the loop's own waits (``advance``)."""

    def __init__(self):
        self._virtual_now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += max(0.0, seconds)


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(main)`` on a ``VirtualTimeLoop``."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
