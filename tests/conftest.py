"""Shared test helpers: seeding, running one function per replica in threads, and the test tiers.

Tiers: a test is in the fast tier (``-m fast``) unless it starts real swarms (``swarm``), plays a
world scenario (``world``) or is marked ``slow`` (several processes, or seconds of training); one
small real swarm is marked ``fast`` on purpose. The full suite runs everything, longest kinds first
and shared alike between its parallel processes (pytest-xdist), so that they finish together.
"""

from __future__ import annotations

import os

# One compute thread per process: the suite runs in parallel processes (-n 3) that each start more
# (workers, DHT daemons); torch's default of one thread per core would oversubscribe the cores many
# times over. Set before torch is imported, and inherited by every process a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc  # noqa: E402
import itertools  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _prefork(tmp_path_factory):
    """Worker processes of the swarm tests are forked from one interpreter that has imported torch
    and hivemind already (``opendiloco/testing/prefork.py``): each saves some 2.4 s of CPU."""
    from opendiloco.swarm.daemon.p2pd_binary import use_unpacked
    from opendiloco.testing.prefork import PreforkServer
    from opendiloco.testing.proctree import ProcessGroup

    use_unpacked()  # the tests' own P2P daemons too start from the copy setup unpacked into the cache

    if os.environ.get("OPENDILOCO_TEST_PREFORK", "1") == "0":
        yield
        return
    server = PreforkServer(tmp_path_factory.mktemp("prefork"))
    ProcessGroup.prefork = server
    try:
        yield
    finally:
        ProcessGroup.prefork = None
        server.close()


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


_HEAVY = ("world", "swarm", "slow")
"""Markers of the tests kept out of the fast tier, in the order the full suite starts them."""


def pytest_collection_finish(session):
    """What importing torch, hivemind and the test modules made is left out of garbage collection
    from here on: the in-process swarms, and the DHT processes they fork, would otherwise walk all of
    it in every full collection."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(m) for m in _HEAVY):
            item.add_marker(pytest.mark.fast)

    def cost(item) -> int:  # a stable sort: files keep their order within a kind
        return next((i for i, m in enumerate(_HEAVY) if item.get_closest_marker(m)), len(_HEAVY))

    # Longest kinds first, dealt into one share per process alike: xdist's work stealing hands each
    # process one contiguous share (sized as below), and each should start with its part of the long
    # tests. The world scenarios all go to the first share: their hosts mostly wait on emulated links
    # (a third of two cores sat idle while every process played one), so the others run swarm tests;
    # the first share is dealt nothing else for as many rounds as it holds world tests.
    ordered = sorted(items, key=cost)
    shares = int(getattr(config, "workerinput", {}).get("workercount", 1))
    sizes, left = [], len(ordered)
    for share in range(shares):
        sizes.append(left // (shares - share))
        left -= sizes[-1]
    world = [item for item in ordered if item.get_closest_marker("world")]
    dealt = [world[:sizes[0]]] + [[] for _ in range(shares - 1)]
    turns = itertools.chain([s for _ in dealt[0] for s in range(1, shares)], itertools.cycle(range(shares)))
    for item in world[sizes[0]:] + [item for item in ordered if not item.get_closest_marker("world")]:
        share = next(turns)
        while len(dealt[share]) >= sizes[share]:
            share = next(turns)
        dealt[share].append(item)
    items[:] = [item for part in dealt for item in part]
