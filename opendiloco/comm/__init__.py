"""How a pseudo-gradient is averaged across workers. Only ``hivemind.py`` here imports hivemind."""

from .base import AverageResult, AveragingError, BehindError, Communicator
from .compression import CODECS, get_codec
from .local import InProcessGroup, SingleWorker

__all__ = [
    "CODECS",
    "AverageResult",
    "AveragingError",
    "BehindError",
    "Communicator",
    "InProcessGroup",
    "SingleWorker",
    "get_codec",
]
