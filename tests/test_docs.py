"""The docs a user reads are a guide: results with their scale, no development history in them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_READ = ["README.md", "docs/deployment.md", "docs/config.md"]
HISTORY = re.compile(r"\bissue\b|\b20\d\d-\d\d-\d\d\b|\b(last|this|previous|next) (stop|session)\b|\bsession\b", re.I)


def test_the_docs_read_first_hold_no_development_history():
    found = [f"{name}:{n}: {line.strip()[:100]}" for name in FIRST_READ
             for n, line in enumerate((ROOT / name).read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "issues, dates or sessions of development in a user's first docs:\n" + "\n".join(found)


def test_benchmarks_is_one_page_of_results_with_its_scale_said_at_the_top():
    page = (ROOT / "docs/benchmarks.md").read_text()
    assert len(page.splitlines()) <= 400
    top = page[:page.index("\n## ")]
    assert "4.4M parameters" in top and "2-core" in top and "GPU" in top and "wide-area" in top
    assert not HISTORY.search(page), HISTORY.search(page)
    sections = re.split(r"\n## ", page)[1:]
    without = [s.splitlines()[0] for s in sections if "python" not in s]
    assert not without, f"results without the command that reproduces them: {without}"
    log = ROOT / "docs/log/benchmarks.md"
    assert len(log.read_text().splitlines()) > 2000, "the dated history is kept in the log"


def test_every_result_file_the_docs_name_is_there():
    names = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        names |= set(re.findall(r"docs/(bench_[\w]+\.json)", doc.read_text()))
    missing = sorted(n for n in names if not (ROOT / "docs" / n).is_file())
    assert not missing, missing


def test_no_guide_page_names_an_issue_or_a_date_of_development():
    dated = re.compile(r"\bissue\b|\b20\d\d-\d\d-\d\d\b", re.I)
    found = [f"{page.name}:{n}" for page in sorted((ROOT / "docs").glob("*.md"))
             for n, line in enumerate(page.read_text().splitlines(), 1) if dated.search(line)]
    assert not found, f"the history belongs in docs/log/: {found}"
