"""A worker's calls to its DHT process, answered by number through one pipe (``swarm/daemon/dht_calls.py``)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time

import pytest
import torch.multiprocessing

from opendiloco.swarm.daemon.node import start_dht
from tests.conftest import run_in_threads

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


@pytest.fixture
def node():
    dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield dht
    dht.shutdown()


async def echo(dht, dht_node, value, delay=0.0):
    await asyncio.sleep(delay)
    return value


async def own_id(dht, dht_node):
    return dht_node.peer_id.to_base58()


async def fails(dht, dht_node):
    raise ValueError("raised in the DHT process")


async def unsendable(dht, dht_node):
    return lambda: None  # cannot be pickled back


def test_calls_from_many_threads_each_get_their_own_answer(node):
    def work(t: int):
        for i in range(20):  # answers come back out of order: later calls overtake slower ones
            value = node.run_coroutine(functools.partial(echo, value=(t, i), delay=0.01 * (i % 3)))
            assert value == (t, i)
        assert node.get(f"nothing-{t}", latest=True) is None  # hivemind's own calls, by the same way

    run_in_threads([lambda t=t: work(t) for t in range(8)], timeout=60)


def test_a_call_is_awaitable_cancellable_and_fails_with_what_was_raised(node):
    async def main():
        return await node.run_coroutine(own_id, return_future=True)

    assert asyncio.run(main()) == node.peer_id.to_base58()
    with pytest.raises(ValueError, match="raised in the DHT process"):
        node.run_coroutine(fails)
    with pytest.raises(RuntimeError, match="could not be sent back"):
        node.run_coroutine(unsendable)

    future = node.run_coroutine(functools.partial(echo, value="late", delay=1.0), return_future=True)
    assert future.cancel() and future.cancelled()
    assert node.run_coroutine(own_id) == node.peer_id.to_base58()  # its late answer is dropped, the pipe goes on
    time.sleep(1.5)
    assert node.run_coroutine(own_id) == node.peer_id.to_base58()


def test_calls_to_a_dead_dht_process_fail_instead_of_hanging():
    dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        pending = dht.run_coroutine(functools.partial(echo, value=None, delay=3600), return_future=True)
        os.kill(dht.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="ended before it answered"):
            pending.result(30)
        with pytest.raises(RuntimeError, match="has ended"):
            dht.get("anything", return_future=True).result(30)
    finally:
        dht.join(10)


def test_no_torch_shared_memory_manager_is_needed():
    """hivemind picks torch's "file_system" strategy, which starts a torch_shm_manager process in every
    process that makes a node; no tensor crosses our pipes, and torch's default serves the rest."""
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
