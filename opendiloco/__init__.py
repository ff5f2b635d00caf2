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
]
__version__ = "0.1.0"
