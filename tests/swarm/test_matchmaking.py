"""Matchmaking's doorbell: leaders' wake-ups are hints, bounded, and keyed by round and attempt."""

from __future__ import annotations

import threading

from opendiloco.swarm.matchmaking import Doorbell


def test_ring_wakes_a_waiting_member_at_once():
    bell = Doorbell()
    timer = threading.Timer(0.05, bell.ring, args=("7.0", 1))
    timer.start()
    try:
        assert bell.wait("7.0", 1, timeout=30.0)
    finally:
        timer.cancel()


def test_rings_of_other_rounds_or_attempts_do_not_wake():
    bell = Doorbell()
    bell.ring("7.0", 0)
    bell.ring("8.0", 1)
    assert not bell.wait("7.0", 1, timeout=0.05)


def test_a_flood_of_rings_is_bounded():
    bell = Doorbell(remember=16)
    for i in range(10_000):
        bell.ring(f"{i}.0", 0)
    assert len(bell._rung) == 16 and bell.wait("9999.0", 0, timeout=0)
