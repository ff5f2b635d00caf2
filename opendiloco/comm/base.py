"""The small, asynchronous interface between the optimizer and whatever averages pseudo-gradients.

A round is *started* with a flat fp32 vector and *waited for* separately, so a caller can keep
training while it runs::

    work = communicator.start(flat, weight=1.0, key=RoundKey(outer_step=7))
    ...                                 # inner steps go on
    result = work.wait()                # AverageResult; raises AveragingError

``average(tensors, ...)`` is ``start(flatten(tensors)).wait()`` for callers that hold a list.
Nothing here imports hivemind or asyncio.
"""

from __future__ import annotations

import concurrent.futures
import time
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

from ..errors import AveragingError, BehindError
from ..pacing import Pace
from .buffers import flatten, unflatten

__all__ = ["AverageResult", "AveragingError", "BehindError", "Communicator", "Progress", "RoundKey", "Work"]


@dataclass(frozen=True, order=True)
class RoundKey:
    """What a round averages: the outer step, and (with streaming) which fragment of the model."""

    outer_step: int
    fragment: int = 0

    def __post_init__(self):
        for name in ("outer_step", "fragment"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"RoundKey.{name} must be a non-negative int, got {value!r}")

    def __str__(self) -> str:
        return f"{self.outer_step}.{self.fragment}"


@dataclass
class AverageResult:
    flat: torch.Tensor
    """The weighted average, flat fp32 on CPU, identical on every member."""
    peers: tuple[str, ...]
    """Ids of the workers whose contributions are in the average (this one included)."""
    total_weight: float
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)
    """Set by ``average()``: views of ``flat`` shaped like its input tensors."""

    @property
    def group_size(self) -> int:
        return len(self.peers)


class Work(ABC):
    """A round in flight. ``wait`` returns its result or raises ``AveragingError``; it may be called again."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> AverageResult: ...

    @abstractmethod
    def done(self) -> bool: ...


class CompletedWork(Work):
    """A round that finished (or failed) inside ``start``."""

    def __init__(self, result: AverageResult | None = None, error: AveragingError | None = None):
        self._result, self._error = result, error

    def wait(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._result

    def done(self):
        return True


class FutureWork(Work):
    """A round running elsewhere (a thread), as a ``concurrent.futures.Future`` of an ``AverageResult``."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def wait(self, timeout=None):
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            # Before Python 3.11 this is not the builtin TimeoutError: name it explicitly.
            raise AveragingError(f"round still running after {timeout:.1f}s") from None
        except AveragingError:
            raise
        except Exception as e:  # a bug or a transport error must not escape as something else
            raise AveragingError(f"{type(e).__name__}: {e}") from e

    def done(self):
        return self._future.done()


@dataclass(kw_only=True)
class Progress:
    """What a worker says of its progress (``Communicator.report_progress``): the part of its record in
    a swarm (``opendiloco.swarm.records.WorkerRecord``, which extends this class with what the swarm
    sets itself) that the worker sets. Each field keeps its name and type on the wire."""

    outer_step: int = -1
    inner_step: int = 0
    samples_per_s: float = 0.0
    loss: float | None = None
    global_hash: str = ""
    last_sync_time: float = 0.0
    ready_at: float | None = None
    """DHT time at which this worker expects to enter its next round (an absolute time, so a
    heartbeat that republishes the record does not push it back). Reported as ``ready_in``."""
    ready: bool = False
    """It has stopped training and waits for its round (its ``round_work`` is final)."""
    next_round: int = -1
    """The round (outer step) it heads for: ``outer_step``, or one more while a streamed round is
    still in flight (it started round ``outer_step`` and has not applied it yet). -1: not said."""
    round_work: float = 0.0
    """Samples (or inner steps) this worker has put into the current round so far."""
    work_rate: float = 0.0
    """Its work per second while training (0 until measured)."""
    work_per_step: float = 0.0
    pace_time: float = 0.0
    """DHT time at which ``round_work`` was true (set when ``round_work`` is reported)."""
    steps_per_s: float = 0.0
    contributed_steps: int = 0
    """Inner steps of this worker that entered an average, since it started."""
    dropped_steps: int = 0
    """Inner steps it threw away (left out of a round under ``pace = fixed``, healed drift, NaN)."""
    name: str = ""
    """The name its user gave the worker, for people reading the run; never trusted."""


def _kinds(annotation) -> tuple[type, ...]:
    """The types a field of ``Progress`` takes: ``float`` takes ints too, ``X | None`` takes None."""
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return tuple(k for kind in kinds for k in ((int, float) if kind is float else (kind,)))


_HINTS = typing.get_type_hints(Progress)
PROGRESS_FIELDS: dict[str, tuple[type, ...]] = {
    **{f.name: _kinds(_HINTS[f.name]) for f in fields(Progress)},
    "ready_in": (int, float, type(None)),
}
"""What ``report_progress`` takes, and the types of each: the fields of ``Progress``, and ``ready_in``
(seconds from now; published as ``ready_at``, a DHT time)."""


def check_progress(reported: Mapping[str, object]) -> None:
    """Refuses (``TypeError``) what ``report_progress`` was given that is not a field of ``Progress`` (nor
    ``ready_in``), or not of the field's type: a misspelt field fails at the call, on every
    communicator, instead of vanishing from the record."""
    unknown = reported.keys() - PROGRESS_FIELDS.keys()
    if unknown:
        raise TypeError(f"report_progress got unknown field(s) {sorted(unknown)}; a worker's progress has "
                        f"{sorted(PROGRESS_FIELDS)}")
    for name, value in reported.items():
        kinds = PROGRESS_FIELDS[name]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            wanted = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise TypeError(f"report_progress: {name} must be {wanted}, got {type(value).__name__} {value!r}")


StateProvider = Callable[[], dict]
"""Returns the state a late joiner needs (see ``DiLoCoOptimizer.shareable_state``)."""


@dataclass(frozen=True)
class SharedState:
    """A worker's state for joiners, and what it would adopt: the provider ``DiLoCoOptimizer`` attaches.

    Calling it serves ``serve()``. A transport that downloads for this worker refuses a state larger
    than ``max_bytes`` (the model's bound) before reading it, and one that ``check(state,
    min_outer_step)`` refuses (``ValueError``) before handing it over, so that it can go on to
    another donor (``opendiloco.state_check``).
    """

    serve: StateProvider
    max_bytes: int
    check: Callable[..., None]

    def __call__(self) -> dict:
        return self.serve()


class Communicator(ABC):
    """Averages a flat vector across the workers of a group, once per round key."""

    @property
    @abstractmethod
    def peer_id(self) -> str: ...

    @abstractmethod
    def start(self, flat: torch.Tensor, *, weight: float, key: RoundKey, out: torch.Tensor | None = None,
              error_out: torch.Tensor | None = None) -> Work:
        """Starts the weighted average of ``flat`` (1-D fp32 on CPU) over the group for ``key``.

        The average is written into ``out`` when given (a reused buffer saves allocating and
        faulting in a fresh vector every round), else into a new tensor. The caller must not
        touch ``flat`` or ``out`` until the work is done. The result is either complete
        and identical on every member, or ``wait`` raises ``AveragingError`` and nothing was
        applied. A zero ``weight`` means "take part but contribute nothing" (e.g. a worker whose
        own pseudo-gradient is not finite).

        ``error_out`` (shaped like ``flat``), when given, receives what the wire format lost of this
        worker's contribution: ``flat`` minus the values the group averaged. It is complete once
        the round has succeeded (error feedback adds it to the next contribution).
        """

    @property
    def wire_format(self):
        """The codec this communicator's contributions travel in (``opendiloco.comm.codec``), if it has one:
        the optimizer asks it what a round sends and owes, and what the format needs (error feedback)."""
        return getattr(self, "codec", None)

    @property
    def subset(self):
        """The shared-seed subset (``opendiloco.comm.subset.Subset``) that this communicator's wire format
        names, e.g. ``subset32+int4``; None: whole contributions. The caller (``DiLoCoOptimizer``, which
        knows which values are updates and which are buffers) sends only that subset through ``start``
        (the format's ``start_round``)."""
        return getattr(getattr(self, "codec", None), "subset", None)

    def average(self, tensors: Sequence[torch.Tensor], *, weight: float = 1.0, outer_step: int = 0) -> AverageResult:
        """Blocking convenience: averages a list of tensors; ``result.tensors`` are shaped like them."""
        began = time.perf_counter()
        result = self.start(flatten(tensors), weight=weight, key=RoundKey(outer_step)).wait()
        result.tensors = unflatten(result.flat, tensors)
        result.seconds = result.seconds or time.perf_counter() - began
        return result

    def attach_state_provider(self, provider: StateProvider) -> None:
        """Lets the communicator serve this worker's state to late joiners (no-op by default)."""

    def download_state(self, timeout: float, min_outer_step: int | None = None,
                       max_bytes: int | None = None, majority_hash: str | None = None) -> dict | None:
        """State from a live peer (at ``min_outer_step`` or later, holding ``majority_hash`` if given),
        or None where there is nobody to ask."""
        return None

    def report_progress(self, **fields) -> None:
        """Publishes progress: fields of ``Progress`` (outer step, inner step, throughput, hash...) and
        ``ready_in``. Every communicator refuses a field that is not one, or a value of another type
        (``check_progress``, a ``TypeError``); publishing is a no-op by default."""
        check_progress(fields)

    def peer_paces(self, outer_step: int) -> list[Pace]:
        """The paces other workers published for their round at ``outer_step`` (see ``pacing``).

        Called after every inner step, so it answers from a snapshot and never waits on the
        network. Empty by default: a worker alone paces itself with a fixed ``H``.
        """
        return []

    def shared_decision(self, flag: bool) -> bool:
        """A decision every process of this worker takes alike: the leader's, for a worker made of
        several processes (``comm.ranks.LocalRanks``); a lone process's own by default."""
        return flag

    def interrupt(self) -> None:
        """The worker is stopping: a round still waiting for peers gives up at once (no-op by default).

        Called from a signal handler, so it only sets a flag.
        """

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
