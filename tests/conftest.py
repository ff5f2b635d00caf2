"""Shared test helpers: seeding, and running one function per replica in threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


def run_in_threads(fns: Sequence[Callable[[], object]], timeout: float = 30.0) -> list:
    """Runs each function in its own thread, joins them all with a shared deadline.

    Re-raises the first exception a replica raised; fails the test if a replica hangs.
    """
    results: list = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def wrap(i: int, fn: Callable[[], object]) -> None:
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            errors[i] = e

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True, name=f"replica-{i}")
               for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        pytest.fail(f"replicas did not finish within {timeout}s: {hung}")
    for e in errors:
        if e is not None:
            raise e
    return results


@pytest.fixture
def run_replicas():
    """``run_replicas(fn, n)`` calls ``fn(rank)`` for each rank in a thread; returns the results."""

    def run(fn: Callable[[int], object], n: int, timeout: float = 30.0) -> list:
        return run_in_threads([lambda r=r: fn(r) for r in range(n)], timeout=timeout)

    return run
