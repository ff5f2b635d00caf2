"""Typed errors of the library: callers branch on the type, never on the message."""

from __future__ import annotations


class AveragingError(RuntimeError):
    """A round could not produce a complete, verified average. Nothing was applied."""


class BehindError(AveragingError):
    """The group has already moved past this worker's outer step: load state from a peer instead."""

    def __init__(self, message: str, *, group_outer_step: int, timeout: float | None = None,
                 expected_hash: str | None = None):
        super().__init__(message)
        self.group_outer_step = group_outer_step
        self.timeout = timeout
        """How long catching up may wait for a peer to reach ``group_outer_step`` (None: the caller's bound)."""
        self.expected_hash = expected_hash
        """The θ_global hash the run confirmed for ``group_outer_step``: only a state with it is adopted."""


class DriftError(BehindError):
    """This worker's θ_global differs from the one most of the run holds at the same outer step."""

    def __init__(self, message: str, *, group_outer_step: int, majority_hash: str):
        super().__init__(message, group_outer_step=group_outer_step, expected_hash=majority_hash)
        self.majority_hash = majority_hash


class SplitHold(AveragingError):
    """This worker's group lacks most of the workers it last averaged with (the run may be split): it
    applies nothing and keeps its work for the next round (``swarm/majority.py``)."""


class ProtocolError(AveragingError):
    """A peer sent something that does not fit the round (wrong group, size, code, non-finite, digest...)."""


class NonFiniteError(AveragingError, ValueError):
    """A codec was asked to encode NaN or inf: a round that would carry them fails instead."""


class PeerFailure(AveragingError):
    """A round failed because of these peers (unreachable, refused, or silent until the timeout)."""

    def __init__(self, message: str, peers):
        super().__init__(message)
        self.peers = frozenset(peers)


class Unreachable(PeerFailure):
    """This worker could not open a connection to these peers at all (its dial failed): two workers
    behind NAT whose relay is gone, say. Nothing was exchanged, so nothing is in doubt."""


class Malformed(PeerFailure):
    """These peers sent bytes that failed this worker's own checks (form, size, order, finiteness, a
    digest): evidence this worker holds itself. A refusal, a closed stream or a silence is not: an honest
    member whose round another member broke does all three."""


class InDoubt(PeerFailure):
    """This worker's attempt failed after its whole contribution went out and its shard's whole result
    reached some members (``ask``): they may have completed the round, which they apply even without
    every member's confirmation. The communicator asks them before it retries (``outcome.resolve``)."""

    def __init__(self, message: str, peers, *, group_id: str, me: str, members, ask, held=None):
        super().__init__(message, peers)
        self.group_id, self.me = group_id, me
        self.members = tuple(members)
        """The round's members (this worker included)."""
        self.ask = tuple(ask)
        self.held = held
        """The whole verified average (a ``RoundOutcome``) where every shard reached this worker, else None."""
        self.failed_too: frozenset[str] = frozenset()
        """Members that answered, when asked (``outcome.resolve``), that they failed the attempt too: alive and
        reachable, so not to blame for it, whichever of their streams this worker saw close first."""
        self.distrusted: frozenset[str] = frozenset()
        """Members whose bytes failed this worker's own checks or audit, or that gave up on the attempt blaming
        no other member (``comm/blame.py``): their word that the round completed is not believed."""
        self.gone: frozenset[str] = frozenset()
        """Members taken for gone when asked (left the run's records, said they abandoned the attempt, or no
        dial reached them): not waited for in the retry, which would otherwise wait for a frozen one's
        record to expire or a ping to find it (``swarm/connectivity/frozen.py``); they may still join it."""


class RoundCounted(BehindError):
    """This worker's attempt failed, but its group completed the round without it (``completed``), or may
    have (no member could say): its contribution is, or may be, in the group's average. It adopts the
    group's state at ``group_outer_step`` and never applies or carries that work again."""

    def __init__(self, message: str, *, group_outer_step: int, completed: bool, timeout: float | None = None):
        super().__init__(message, group_outer_step=group_outer_step, timeout=timeout)
        self.completed = completed


class SwarmError(RuntimeError):
    """A clear, user-facing problem with joining or running the swarm."""


class LocalRankFailure(RuntimeError):
    """The processes of a multi-process worker lost one another (a hand-off between them failed, or the
    leader hit an unexpected error). Not an ``AveragingError``: no rank may carry on alone, so callers
    that survive a failed round or download let this one through."""


class Interrupted(AveragingError):
    """The worker was asked to stop (a signal): a wait for peers or a state download was abandoned."""


class TrainError(RuntimeError):
    """A problem of the trainer's run that the user can fix (printed as one line by the CLI)."""
