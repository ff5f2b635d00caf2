"""The table of timeouts (``opendiloco/timeouts.py``): its relations hold, and ``check`` catches a broken one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from opendiloco import timeouts
from opendiloco.timeouts import RELATIONS, Relation, check

SOURCE = Path(timeouts.__file__)
LIBRARY = SOURCE.parent


def test_the_table_keeps_every_relation():
    assert check(timeouts.table()) == []


def test_every_relation_names_bounds_of_the_table():
    table = timeouts.table()
    for relation in RELATIONS:
        assert {*relation.below, relation.above} <= set(table), relation
        assert relation.below and relation.why, relation


def test_every_bound_says_what_it_bounds():
    body = ast.parse(SOURCE.read_text()).body
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, float):
            name = node.targets[0].id
            assert isinstance(after, ast.Expr) and isinstance(after.value.value, str) \
                and after.value.value.strip(), f"{name} has no docstring"


@pytest.mark.parametrize("name, value", [
    ("RESERVE_RETRY_S", 60.0),  # asking more slowly while a relay gives no slot than while all is well
    ("RESERVE_EVERY_S", 7200.0),  # the slot lapses before it is asked for again
    ("RENEW_BEFORE_ROUND_S", 150.0),  # a round may start on a relayed connection the relay is about to end
    ("RELAY_PING_TIMEOUT", 15.0),  # a look at the relays (two bounded calls) outlasts the window that excuses one
    ("REDIAL_TIMEOUT", 5.0),  # no room for hivemind's ping twice: the second must fit too
    ("LEAVE_TIMEOUT", 3.0),  # equal is not below
    ("GROUP_READ_GRACE", 30.0),
    ("DIAL_BACK_TIMEOUT", 12.0),
    ("SNAPSHOT_FRESH_S", 200.0),
    ("FROZEN_PING_EVERY_S", 10.0),
    ("GONE_POLL_S", 4.0),
    ("PACE_RETRY_MAX_S", 0.25),
])
def test_a_row_that_breaks_a_relation_is_caught(name, value):
    table = dict(timeouts.table(), **{name: value})
    broken = check(table)
    assert broken and all(name in (*r.below, r.above) for r in broken), broken


def test_a_relation_whose_bound_is_missing_is_broken():
    table = timeouts.table()
    del table["DHT_CALL_TIMEOUT"]
    assert [r.above for r in check(table)] == ["DHT_CALL_TIMEOUT"]


def test_a_relation_with_a_sum():
    relation = Relation(("A", "A", "C"), "B", "B holds two of A and a C")
    assert check({"A": 3.0, "B": 7.5, "C": 1.0}, (relation,)) == []
    assert check({"A": 3.0, "B": 7.0, "C": 1.0}, (relation,)) == [relation]


BOUND = re.compile(r"^([A-Z][A-Z_]*(_S|TIMEOUT|GRACE))\s*[:=]", re.M)
STAYING = {"clock.py": {"WINDOW_S", "REPORT_S", "JUMP_S", "ISOLATING_JUMP_S", "CORRECT_S"},
           "doctor.py": {"CLOCK_LIMIT_S", "CLOCK_WARN_S"},
           "pacing.py": {"EXTRAPOLATE_S"},
           "transfer.py": {"MIN_RATE_BYTES_PER_S"}}
"""Module constants named like bounds that are not waits: a clock's error, how far a pace is extrapolated,
a rate."""


def test_the_waits_of_the_library_are_in_the_table():
    """A module that defines its own timeout, grace or period (not read from the table) is named."""
    found = {f"{p.relative_to(LIBRARY)}: {m.group(1)}"
             for p in LIBRARY.rglob("*.py") if p != SOURCE and "testing" not in p.parts
             for m in BOUND.finditer(p.read_text()) if m.group(1) not in STAYING.get(p.name, ())}
    assert not found, sorted(found)
