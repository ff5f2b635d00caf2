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


class ProtocolError(AveragingError):
    """A peer sent something that does not fit the round (wrong group, size, code, non-finite, digest...)."""


class NonFiniteError(AveragingError, ValueError):
    """A codec was asked to encode NaN or inf: a round that would carry them fails instead."""


class PeerFailure(AveragingError):
    """A round failed because of these peers (unreachable, refused, or silent until the timeout)."""

    def __init__(self, message: str, peers):
        super().__init__(message)
        self.peers = frozenset(peers)


class SwarmError(RuntimeError):
    """A clear, user-facing problem with joining or running the swarm."""


class LocalRankFailure(RuntimeError):
    """The processes of a multi-process worker lost one another (a hand-off between them failed, or the
    leader hit an unexpected error). Not an ``AveragingError``: no rank may carry on alone, so callers
    that survive a failed round or download let this one through."""


class Interrupted(AveragingError):
    """The worker was asked to stop (a signal): a wait for peers or a state download was abandoned."""
