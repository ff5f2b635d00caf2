"""How a run is asked to stop: SIGINT or SIGTERM lets the step in progress finish, then the worker
checkpoints and exits; a second SIGINT aborts at once."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class StopRequest:
    """SIGINT/SIGTERM ask the loop to finish its step, checkpoint and exit; a second SIGINT aborts.
    Installed for the ``with`` block in the main thread (signals reach no other); elsewhere it never
    hears one."""

    def __init__(self, on_stop: Callable[[], None] | None = None):
        self.requested = False
        self.on_stop = on_stop
        """Called in the handler: e.g. lets an outer step that waits for peers give up."""
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        if self.on_stop is not None:
            self.on_stop()
        log.warning("%s received: finishing this step, then checkpointing and exiting",
                    signal.Signals(signum).name)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
