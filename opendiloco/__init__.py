"""OpenDiLoCo: decentralized DiLoCo training for PyTorch."""

from .comm.base import AverageResult, AveragingError, Communicator
from .comm.local import InProcessGroup, SingleWorker
from .optimizer import DiLoCoOptimizer, SyncReport

__all__ = [
    "AverageResult",
    "AveragingError",
    "Communicator",
    "DiLoCoOptimizer",
    "InProcessGroup",
    "SingleWorker",
    "SyncReport",
]
__version__ = "0.1.0"
