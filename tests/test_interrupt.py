"""A stop request ends a DHT call that is still waiting, at once.

The whole worker: tests/swarm/test_stop_while_waiting.py."""

import concurrent.futures
import threading
import time

import pytest

from opendiloco.errors import AveragingError, Interrupted
from opendiloco.swarm.records import INTERRUPT_POLL, wait_dht


def test_a_dht_call_that_waits_is_abandoned_when_the_worker_stops():
    never = concurrent.futures.Future()  # a DHT whose peers do not answer
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    began = time.monotonic()
    with pytest.raises(Interrupted, match="DHT get abandoned"):
        wait_dht(never, "get", timeout=60, interrupted=stop)
    assert time.monotonic() - began < 0.2 + 10 * INTERRUPT_POLL
    assert never.cancelled()


def test_a_dht_call_still_answers_and_times_out_as_before():
    stop = threading.Event()
    done = concurrent.futures.Future()
    threading.Timer(0.15, done.set_result, ["value"]).start()
    assert wait_dht(done, "get", timeout=60, interrupted=stop) == "value"
    with pytest.raises(AveragingError, match="did not answer a store within"):
        wait_dht(concurrent.futures.Future(), "store", timeout=0.3, interrupted=stop)
    with pytest.raises(AveragingError, match="did not answer a get within"):
        wait_dht(concurrent.futures.Future(), "get", timeout=0.1)  # no stop flag: one plain wait
