"""The import rules of docs/architecture.md, checked on the source: dependencies point one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "opendiloco"
CORE = ["optimizer.py", "outer.py", "pacing.py", "streaming.py", "staging.py", "state_check.py", "fingerprint.py",
        "errors.py", "comm/base.py", "comm/buffers.py", "comm/compression.py", "comm/local.py", "comm/ranks.py",
        "comm/aggregation.py"]


def imports(path: Path) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved against the package)."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                found.add(".".join(base + ((node.module,) if node.module else ())))
            else:
                found.add(node.module)
    return found


def library_files():
    return [p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts]


@pytest.mark.parametrize("name", CORE)
def test_core_imports_no_transport(name):
    bad = {m for m in imports(PACKAGE / name) if m.split(".")[0] in {"hivemind", "asyncio", "uvloop"}}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_only_swarm_imports_hivemind():
    offenders = {str(p.relative_to(PACKAGE)) for p in library_files()
                 if any(m.split(".")[0] == "hivemind" for m in imports(p))
                 and p.relative_to(PACKAGE).parts[0] != "swarm"}
    assert not offenders, offenders


def test_comm_never_imports_the_swarm_or_the_trainer():
    for p in (PACKAGE / "comm").glob("*.py"):
        bad = {m for m in imports(p) if m.startswith(("opendiloco.swarm", "opendiloco.train"))}
        assert not bad, f"{p.name} imports {sorted(bad)}"


def test_the_library_never_imports_its_test_tools():
    offenders = {str(p.relative_to(PACKAGE)) for p in library_files()
                 if any(m.startswith("opendiloco.testing") for m in imports(p))}
    assert not offenders, offenders
