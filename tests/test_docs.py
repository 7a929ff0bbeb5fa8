"""The docs' cross-references hold: every section of docs/BENCHMARKS.md or docs/EXPERIMENTS.md that code, scripts or
docs quote exists, and so does every such section a link names by its anchor, and every file and heading a link of
README.md or docs/*.md names. The README stays a five-minute read (its length; no table cell a paragraph, in it,
docs/GUIDE.md or docs/CLI.md) and its families table is what ``seqgen models`` lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("BENCHMARKS", "EXPERIMENTS")
# docs/BENCHMARKS.md ("Section"), docs/BENCHMARKS.md, "Section" or a link [..](docs/BENCHMARKS.md), "Section"
# (EXPERIMENTS.md alike); a quote may wrap
QUOTE = re.compile(r'\b(BENCHMARKS|EXPERIMENTS)\.md\)?(?:,\s*|\s*\(\s*)"([^"]+)"')
# a link to a section: (docs/EXPERIMENTS.md#int8-weight-cache-start-up)
ANCHOR = re.compile(r"\b(BENCHMARKS|EXPERIMENTS)\.md#([\w-]+)\)")


def _headings(doc: str) -> list[str]:
    text = (REPO / "docs" / f"{doc}.md").read_text(encoding="utf-8")
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _files() -> list[Path]:
    return [
        *REPO.glob("seqgen_cli/**/*.py"),
        *REPO.glob("scripts/**/*.py"),
        *REPO.glob("scripts/**/*.md"),
        *REPO.glob("docs/*.md"),
        REPO / "README.md",
    ]


def _quotes() -> list[tuple[str, str, str]]:
    found = []
    for path in _files():
        text = path.read_text(encoding="utf-8")
        for match in QUOTE.finditer(text):
            # a docstring's wrapped quote: its line break and indentation read as one space
            name = re.sub(r"\s+", " ", match.group(2)).strip()
            found.append((str(path.relative_to(REPO)), match.group(1), name))
    return found


def test_the_quote_pattern_finds_the_references() -> None:
    quotes = _quotes()
    for doc in DOCS:  # the pattern still matches how the code cites sections of each
        assert len([q for q in quotes if q[1] == doc]) >= 10, doc


@pytest.mark.parametrize("doc", DOCS)
def test_every_quoted_section_exists(doc: str) -> None:
    headings = _headings(doc)
    quoted = [(path, name) for path, d, name in _quotes() if d == doc]
    stale = [(path, name) for path, name in quoted if not any(h.startswith(name) for h in headings)]
    assert not stale, f"sections quoted but not in docs/{doc}.md: {stale}"


def test_every_linked_section_exists() -> None:
    slugs = {doc: {_slug(h) for h in _headings(doc)} for doc in DOCS}
    links = [
        (str(path.relative_to(REPO)), m.group(1), m.group(2))
        for path in _files()
        for m in ANCHOR.finditer(path.read_text(encoding="utf-8"))
    ]
    assert links, "the anchor pattern still matches how the docs link sections"
    stale = [link for link in links if link[2] not in slugs[link[1]]]
    assert not stale, f"sections linked but not in the docs: {stale}"


def test_a_section_lives_in_one_of_the_two() -> None:
    """A title in both files would make a citation of either ambiguous to a reader."""
    both = set(_headings("BENCHMARKS")) & set(_headings("EXPERIMENTS"))
    assert not both, both


BENCHMARKS_LINES = 450  # current tables with their commands; what chose a design goes to docs/EXPERIMENTS.md


def test_benchmarks_holds_current_tables_only() -> None:
    """docs/BENCHMARKS.md is a reference of current figures, not a journal: a measurement that only chose a design
    moves to docs/EXPERIMENTS.md once recorded, so the file stays short enough to read."""
    lines = (REPO / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8").count("\n")
    assert lines <= BENCHMARKS_LINES, f"docs/BENCHMARKS.md has {lines} lines (at most {BENCHMARKS_LINES})"


def test_the_readme_families_table_is_the_codes() -> None:
    """The README's families table names exactly the model types ``seqgen models`` lists (families.FAMILIES and
    models.NO_BACKEND): a family added or dropped in the code fails here until the table says so."""
    from tests.helpers import seqgen

    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| family (`config.model_type`)") :].split("\n\n", 1)[0].splitlines()[2:]
    documented = {name for row in table for name in re.findall(r"`([a-z0-9_-]+)`", row.split("|")[1])}
    res = seqgen("models")
    assert res.exit_code == 0, res.stderr
    listed = {line.split()[0] for line in res.stdout.splitlines() if not line.startswith("(other)")}
    assert documented == listed, (sorted(documented - listed), sorted(listed - documented))


# -- the README is read in five minutes; the rest is in docs/GUIDE.md, docs/CLI.md ------------------------------

README_LINES = 220  # what it is, the set-up, five recipes, the families table, where to read on
WRITTEN = (  # every doc: README.md and docs/GUIDE.md, docs/CLI.md read first
    "README.md",
    "docs/GUIDE.md",
    "docs/CLI.md",
    "docs/ARCHITECTURE.md",
    "docs/BENCHMARKS.md",
    "docs/EXPERIMENTS.md",
    "scripts/README.md",
)
CELL_CHARS = 200  # a longer explanation is prose (docs/GUIDE.md) or an option's help text (docs/CLI.md)


def _outside_code(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def test_the_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_LINES, (
        f"README.md has {lines} lines (at most {README_LINES}): move the rest to docs/GUIDE.md"
    )


@pytest.mark.parametrize("doc", WRITTEN)
def test_no_table_cell_is_a_paragraph(doc: str) -> None:
    rows = [line for line in _outside_code((REPO / doc).read_text(encoding="utf-8")) if line.startswith("|")]
    cells = [cell.strip() for row in rows for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
    assert cells or doc != "README.md", "the table pattern still finds the README's tables"
    long = [cell for cell in cells if len(cell) > CELL_CHARS]
    assert not long, (
        f"{doc}: table cells over {CELL_CHARS} characters (prose belongs in docs/GUIDE.md): {long}"
    )


def _anchors(path: Path) -> set[str]:
    lines = _outside_code(path.read_text(encoding="utf-8"))
    return {_slug(line.lstrip("#").strip()) for line in lines if line.startswith("#")}


def test_links_between_the_docs_hold() -> None:
    """Every relative link of the README and docs/*.md names a file that exists and, with #anchor, a heading of it:
    a section moved between README and guide fails here until its links follow."""
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = "\n".join(_outside_code(doc.read_text(encoding="utf-8")))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append((doc.name, target))
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append((doc.name, target))
    assert not broken, f"links to no file or no heading: {broken}"
