"""OpenDiLoCo: decentralized DiLoCo training for PyTorch."""

from .comm.base import AverageResult, Communicator, RoundKey, Work
from .comm.local import InProcessGroup, SingleWorker
from .errors import AveragingError, BehindError
from .optimizer import DiLoCoOptimizer, SyncReport

__all__ = [
    "AverageResult",
    "AveragingError",
    "BehindError",
    "Communicator",
    "DiLoCoOptimizer",
    "InProcessGroup",
    "RoundKey",
    "SingleWorker",
    "SyncReport",
    "Work",
    "connect",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # ``connect`` joins a swarm (hivemind) with the trainer's [swarm] keys: loaded on first use, so that
    # ``import opendiloco`` stays the optimizer and its interfaces alone.
    if name == "connect":
        from .train.worker import connect

        return connect
    raise AttributeError(f"module 'opendiloco' has no attribute {name!r}")
