"""The docs' cross-references hold: every section of docs/BENCHMARKS.md that code, scripts or docs quote exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# docs/BENCHMARKS.md ("Section"), docs/BENCHMARKS.md, "Section" or a link [..](docs/BENCHMARKS.md), "Section"; a quote may wrap
QUOTE = re.compile(r'BENCHMARKS\.md\)?(?:,\s*|\s*\(\s*)"([^"]+)"')


def _headings() -> list[str]:
    text = (REPO / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]


def _quotes() -> list[tuple[str, str]]:
    files = [
        *REPO.glob("seqgen_cli/**/*.py"),
        *REPO.glob("scripts/**/*.py"),
        *REPO.glob("docs/*.md"),
        REPO / "README.md",
    ]
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for match in QUOTE.finditer(text):
            # a docstring's wrapped quote: its line break and indentation read as one space
            found.append((str(path.relative_to(REPO)), re.sub(r"\s+", " ", match.group(1)).strip()))
    return found


def test_the_quote_pattern_finds_the_references() -> None:
    assert len(_quotes()) >= 10  # the pattern still matches how the code cites sections


def test_every_quoted_benchmarks_section_exists() -> None:
    headings = _headings()
    stale = [(path, name) for path, name in _quotes() if not any(h.startswith(name) for h in headings)]
    assert not stale, f"sections quoted but not in docs/BENCHMARKS.md: {stale}"
