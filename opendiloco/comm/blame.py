"""Who broke an attempt: what a refusal or a question about a round says of its sender's failure.

A member whose attempt failed refuses the streams it still has in that round (``REFUSE``) and asks the
others how the round ended (``ASK_OUTCOME``); each carries ``blame``, the members its own failure
names. A peer that receives either while it still needs the sender's bytes fails its attempt too. Whether
it also names the sender as the attempt's breaker (left out of the rest of the round's attempts:
``swarm/exclusion.py``) is one rule, ``breaks_attempt``:

- the sender blames a third member of the round (neither itself nor the receiver): it failed because
  of someone else, and says so; not named. A name that is no member of the round counts for nothing.
  An insider that blames an honest member to escape is named by that member,
  who knows its own conduct, and the group rule (``exclusion.conflict_free``) weighs who names whom;
- it blames nobody, itself, or only the receiver: named. The receiver knows what it sent; a member that
  gives up without naming anyone else is the cause as far as the receiver can tell.

A refusal marked ``stale`` says its sender is not in that attempt at all (it is in another group of the
round, completed it in another one, or never learnt of this group): honest members say that in a
matchmaking race, so it names nobody (``breaks_attempt`` is not asked).

Pure: no I/O, no clock.
"""

from __future__ import annotations

MAX_BLAMED = 16
"""The most peers a refusal or a question about a round names as the cause of its sender's failure."""


def blamed(value) -> frozenset[str]:
    """The peer ids a ``blame`` field names (anything out of form: none; at most ``MAX_BLAMED``)."""
    if not isinstance(value, list):
        return frozenset()
    return frozenset([p for p in value if isinstance(p, str) and 0 < len(p) <= 128][:MAX_BLAMED])


def breaks_attempt(sender: str, receiver: str, blame: frozenset[str], members) -> bool:
    """Whether ``receiver`` names ``sender`` as the breaker of an attempt (of ``members``) that ``sender``
    gave up on (refused, or asked how it ended) saying ``blame`` caused it."""
    return not (set(blame) & (set(members) - {sender, receiver}))
