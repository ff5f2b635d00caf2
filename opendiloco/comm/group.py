"""The group of one round: its members, how they cut the flat vector into shards and parts, and the
name that identifies the round on the wire.

A group of G members splits the flat vector into contiguous shards; member j owns shard j. A member
that others reach only through a relay (``Group.relayed``: behind NAT) owns an empty shard, so the
bulk of the round flows to members that accept connections (``shard_bounds_for``). Every shard is
cut into parts of ``part_numel`` values, which travel and are averaged one at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..fingerprint import new_hasher
from .aggregation import Aggregation
from .base import RoundKey
from .compression import Codec, codec_label

DEFAULT_PART_NUMEL = 1 << 18  # 256 Ki values: 512 KiB in fp16, a multiple of every codec's block
MAX_WEIGHT = 1e12
"""The largest weight a member may declare for its contribution."""


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [start, end) ranges covering ``numel`` elements."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def shard_bounds_for(numel: int, members: Sequence[str],
                     relayed: frozenset[str] = frozenset()) -> list[tuple[int, int]]:
    """Each member's [start, end) of the flat vector: nearly equal shards for the members not in
    ``relayed``, empty ones for those in it (every member's shard is equal if all are relayed)."""
    owners = [m for m in members if m not in relayed] or list(members)
    sizes = iter(shard_bounds(numel, len(owners)))
    bounds, cursor = [], 0
    for m in members:
        if m in owners:
            a, b = next(sizes)
            cursor += b - a
            bounds.append((cursor - (b - a), cursor))
        else:
            bounds.append((cursor, cursor))
    return bounds


def part_bounds(numel: int, part_numel: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most ``part_numel`` values; one empty part for an empty shard."""
    if numel == 0:
        return [(0, 0)]
    return [(a, min(a + part_numel, numel)) for a in range(0, numel, part_numel)]


def group_label(codec: Codec, result_codec: Codec | None, aggregation: Aggregation, audit_chunks: int) -> str:
    """What a group's members must agree on, e.g. ``fp16|mean-clip4-w4|audit4``: the wire formats
    (``contribution`` or ``contribution/result``), how owners aggregate, and how much members audit.
    Matchmaking groups only announcements that carry the same label; an opening frame names it."""
    label = f"{codec_label(codec, result_codec)}|{aggregation.label}"
    return label + (f"|audit{audit_chunks}" if audit_chunks else "")


def make_group_id(run_id: str, key: RoundKey, attempt: int, members: Sequence[str],
                  relayed: frozenset[str] = frozenset()) -> str:
    """The round's name on the wire; members that split the vector differently name it differently."""
    h = new_hasher()
    h.update(f"{run_id}|{key}|{attempt}|{','.join(members)}".encode())
    if relayed:
        h.update(f"|relayed:{','.join(sorted(relayed))}".encode())
    return h.hexdigest()[:24]


@dataclass(frozen=True)
class Group:
    """The members of one round, in shard order, and the id that names the round on the wire."""

    group_id: str
    members: tuple[str, ...]
    key: RoundKey
    relayed: frozenset[str] = frozenset()
    """Members the others reach only through a relay (behind NAT): they own empty shards."""
    attempt: int = -1
    """Which attempt at ``key`` it is (-1: not known). A member in one group of an attempt never joins
    another group of it, nor of an earlier one (``Rounds.serve``)."""

