"""How a pseudo-gradient is averaged across workers: the interface, codecs, buffers, the round runner.

Nothing here imports hivemind: the swarm transport lives in ``opendiloco.swarm``.
"""

from ..errors import AveragingError, BehindError
from .base import AverageResult, Communicator, RoundKey, Work
from .formats import CODECS, get_codec
from .local import InProcessGroup, SingleWorker
from .ranks import LocalRanks

__all__ = [
    "CODECS",
    "AverageResult",
    "AveragingError",
    "BehindError",
    "Communicator",
    "InProcessGroup",
    "LocalRanks",
    "RoundKey",
    "SingleWorker",
    "Work",
    "get_codec",
]
