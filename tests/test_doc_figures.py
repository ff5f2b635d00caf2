"""Figures the docs print beside the command that gives them, rerun: a doc figure that the landed code
no longer gives fails here (a figure of docs/compression.md once did not reproduce, unnoticed)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"<!-- figure: (?P<name>[\w-]+) -->\n    (?P<command>[^\n]+)\n\nand expects its held-out loss, "
                    r"\*\*(?P<loss>[0-9.]+)\*\*")


def doc_figures(path: Path) -> dict[str, tuple[list[str], float]]:
    """The marked figures of a doc: name -> (command, held-out loss)."""
    return {m["name"]: (shlex.split(m["command"]), float(m["loss"])) for m in FIGURE.finditer(path.read_text())}


def test_the_marked_figures_are_found():
    figures = doc_figures(ROOT / "docs" / "compression.md")
    command, loss = figures["topk-short"]
    assert command[:3] == [".venv/bin/python", "-m", "benchmarks.convergence"] and loss > 0


@pytest.mark.slow
def test_the_short_top_k_run_gives_the_figure_of_the_compression_doc(tmp_path):
    command, loss = doc_figures(ROOT / "docs" / "compression.md")["topk-short"]
    results = tmp_path / "results.json"
    subprocess.run([sys.executable, *command[1:], "--work", str(tmp_path / "work"), "--results", str(results)],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    runs = json.loads(results.read_text())["runs"]
    (got,) = [next(iter(r["losses"].values())) for r in runs.values() if r["method"] == "diloco"]
    assert round(got, 4) == loss, f"the run gives {got:.4f}; docs/compression.md says {loss}"
