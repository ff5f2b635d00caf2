"""Seeding torch's generator: a model's initial weights from its own seed, and the trainer's generators,
one block at a time in a process (workers in threads of one process share torch's generator)."""

from __future__ import annotations

import contextlib
import random
import threading

import torch

_SEEDED = threading.Lock()


def seed_generators(seed: int) -> None:
    """Seeds torch's and Python's generators, outside any ``seeded`` block: a trainer seeding them in one
    thread while another thread draws a model's initial weights would reset that model's draws midway."""
    with _SEEDED:
        torch.manual_seed(seed)
        random.seed(seed)


@contextlib.contextmanager
def seeded(seed: int):
    """torch's generator seeded with ``seed`` for the block, then put back as it was. One block at a
    time in a process: two models drawn at once (workers in threads) would interleave their draws."""
    with _SEEDED:
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.random.set_rng_state(rng_state)
