"""One word per thing: docs/ARCHITECTURE.md's "Words" table, read here, holds the code's names to it.

Each row's last column, *names in code*, is a rule over every name ``seqgen_cli/`` defines (functions, methods,
classes, parameters, variables, ``self`` attributes, import aliases), read with ``ast``: ```x` only in `a/`, `b.py```
(a name built on ``x`` is defined only under those paths) or ``never `x` `` (nowhere). A name is *built on* a word
when the word is one of its parts, split at ``_`` and capitals (``use_int8_engine``, ``Engine``, ``INT8_ENGINES``:
a plural counts). Every word of the first column is in use (the code or the docs outside the table: a stale row
fails), and every name the table quotes (``Generator.detokenise``, ``models/prefill.py``, ``--keep-stop``) is the
code's. ARCHITECTURE's module list names every module of the package.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "seqgen_cli"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"


@dataclass(frozen=True)
class Rule:
    """Names built on ``names`` are defined only under ``only_in`` (paths under ``seqgen_cli/``; a folder ends in
    ``/``), or nowhere (``only_in`` empty: *never*)."""

    names: tuple[str, ...]
    only_in: tuple[str, ...] = ()

    def allows(self, path: str) -> bool:
        return any(path == p or (p.endswith("/") and path.startswith(p)) for p in self.only_in)


@dataclass(frozen=True)
class Row:
    """One row of the Words table: its words (the first column's italics), its cells, its rule (``None``: ``-``)."""

    words: tuple[str, ...]
    means: str
    not_: str
    rule: Rule | None


def parse_rule(cell: str) -> Rule | None:
    """The last column: ``-``; ```x`, `y` only in `a/`, `b.py```; ``never `x`, `y` ``."""
    cell = cell.strip()
    if cell in ("", "-"):
        return None
    if cell.startswith("never "):
        return Rule(tuple(re.findall(r"`([^`]+)`", cell)))
    names, sep, paths = cell.partition(" only in ")
    assert sep, f"a rule is '`x` only in `path`' or 'never `x`': {cell!r}"
    return Rule(tuple(re.findall(r"`([^`]+)`", names)), tuple(re.findall(r"`([^`]+)`", paths)))


def words_table(text: str) -> list[Row]:
    """The rows of the table under ``## Words``."""
    section = text[text.index("## Words\n") :]
    section = section[: section.index("\n## ", 1)]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header, *rows = lines
    assert [c.strip() for c in header.strip("|").split("|")] == ["word", "means", "not", "names in code"], (
        header
    )
    out = []
    for line in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if set(cells[0]) <= {"-", " "}:  # the separator row
            continue
        word, means, not_, rule = cells
        out.append(Row(tuple(re.findall(r"\*([^*]+)\*", word)), means, not_, parse_rule(rule)))
    return out


def parts(name: str) -> list[str]:
    """``use_int8_engine`` -> use, int8, engine; ``RefillStats`` -> refill, stats; ``INT8_ENGINES`` -> int8, engines."""
    return [
        p.lower() for chunk in name.split("_") for p in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", chunk)
    ]


def built_on(name: str, word: str) -> bool:
    return any(p in (word, word + "s") for p in parts(name))


def definitions(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every name a module defines, with its line: functions, classes, parameters, assigned names (variables,
    constants, loop and ``with`` targets), ``self.x`` / ``cls.x`` attributes, import aliases."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id, node.lineno
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            yield node.attr, node.lineno
        elif isinstance(node, ast.alias) and node.asname:
            yield node.asname, getattr(node, "lineno", 0)


def violations(rule: Rule, sources: Mapping[str, str]) -> list[str]:
    """``path:line name`` for each name built on the rule's words outside the paths it allows."""
    found = []
    for path, text in sorted(sources.items()):
        if rule.allows(path):
            continue
        for name, line in definitions(ast.parse(text)):
            if any(built_on(name, word) for word in rule.names):
                found.append(f"{path}:{line} {name}")
    return found


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def rows() -> list[Row]:
    return words_table(ARCHITECTURE.read_text(encoding="utf-8"))


def test_the_table_is_read() -> None:
    table = rows()
    words = {w for row in table for w in row.words}
    assert len(table) >= 25 and {"engine", "step", "detokenise", "t", "backend", "fixed", "ledger"} <= words
    ruled = {w for row in table if row.rule for w in row.rule.names}
    assert {"engine", "decode", "family", "rounds"} <= ruled, ruled


def test_the_code_keeps_each_rule_of_the_table() -> None:
    """*engine* names the decode loop only (a backend is a backend), ``decode`` is the backend's tensor step only
    (token ids to text is ``detokenise``), the step counter is ``t``: whatever the table's last column says."""
    sources = package_sources()
    broken = {row.words[0]: violations(row.rule, sources) for row in table_with_rules()}
    assert not any(broken.values()), {word: found for word, found in broken.items() if found}


def table_with_rules() -> list[Row]:
    return [row for row in rows() if row.rule is not None]


def test_decode_is_the_backends_step_only() -> None:
    """The table's *step* rule read by class: every function named ``decode`` is a method of a backend class (the
    tensor step: ``FastBackend.decode``); token ids to text is ``Generator.detokenise``."""
    found = []
    for path, text in package_sources().items():
        tree = ast.parse(text)
        methods = {
            id(f): cls.name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for f in cls.body
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "decode":
                if "Backend" not in methods.get(id(node), ""):
                    found.append(f"{path}:{node.lineno} {methods.get(id(node), '(module)')}.decode")
    assert not found, found
    from seqgen_cli.generator import Generator

    assert callable(Generator.detokenise) and not hasattr(Generator, "decode")


def _in_use(word: str, code: str, docs: str) -> bool:
    """``word`` (or its snake_case spelling) in the code, or in the docs outside the Words table."""
    pattern = re.compile(r"\b" + re.escape(word).replace(r"\ ", r"[ _]") + r"s?\b", re.IGNORECASE)
    return bool(pattern.search(code) or pattern.search(docs))


def _docs_without_the_table() -> str:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    start = text.index("## Words\n")
    rest = text[start:]
    others = [
        p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")) if p != ARCHITECTURE
    ]
    return "\n".join(
        [text[:start], rest[rest.index("\n## ", 1) :], *others, (REPO / "README.md").read_text()]
    )


def stale_words(table: list[Row], code: str, docs: str) -> list[str]:
    return [w for row in table for w in row.words if not _in_use(w, code, docs)]


def test_every_word_of_the_table_is_in_use() -> None:
    code = "\n".join(package_sources().values())
    assert not stale_words(rows(), code, _docs_without_the_table())


# -- what the table quotes is the code's --------------------------------------------------------------------------


def _index() -> tuple[dict[str, set[str]], dict[str, set[str]], set[str]]:
    """Classes -> their names (methods, fields, ``self`` attributes, bases' names); modules (by file stem) -> their
    top-level names; every name the package defines or reads."""
    classes: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    every: set[str] = set()
    for path, text in package_sources().items():
        tree = ast.parse(text)
        stem = Path(path).parent.name if path.endswith("__init__.py") else Path(path).stem
        top = modules.setdefault(stem, set())
        for node in tree.body:
            top.update(
                name
                for name, _ in definitions(node)
                if not isinstance(node, ast.ClassDef) or name == node.name
            )
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top.update((a.asname or a.name).split(".")[-1] for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = classes.setdefault(node.name, set())
                names.update(name for name, _ in definitions(node))
                names.update(b.id for b in node.bases if isinstance(b, ast.Name))
            elif isinstance(node, ast.Attribute):
                every.add(node.attr)
            elif isinstance(node, ast.Name):
                every.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                every.add(node.value)
        every.update(name for name, _ in definitions(tree))
    return classes, modules, every


def _class_has(classes: dict[str, set[str]], cls: str, name: str) -> bool:
    seen, todo = set(), [cls]
    while todo:
        c = todo.pop()
        if c in seen or c not in classes:
            continue
        seen.add(c)
        if name in classes[c]:
            return True
        todo.extend(classes[c])  # its bases' names are among its own: follow them
    return False


def _cli_options() -> set[str]:
    """Every option of every ``seqgen`` command (``--keep-stop``, ``--no-refill``)."""
    import click

    from seqgen_cli.cli import main

    commands = [main, *main.commands.values()]
    return {
        o
        for c in commands
        for p in c.params
        if isinstance(p, click.Option)
        for o in (*p.opts, *p.secondary_opts)
    }


def unknown_references(table: list[Row]) -> list[str]:
    """The table's quoted names (in its means and not cells) that the code does not have: a path under
    ``seqgen_cli/`` that is not there, ``Class.name`` or ``module.name`` not defined there, a snake_case or
    CamelCase name defined nowhere, an option no command declares (shape letters and values are not names)."""
    classes, modules, every = _index()
    options = _cli_options()
    unknown = []
    for row in table:
        for quoted in re.findall(r"`([^`]+)`", row.means + " " + row.not_):
            ref = quoted.split("(")[0].split("[")[0].strip()
            if re.fullmatch(r"[\w/]+(\.py|/)", ref):
                ok = (PACKAGE / ref).exists()
            elif m := re.fullmatch(r"(--[\w-]+)( \w+)*", ref):
                ok = m.group(1) in options
            elif m := re.fullmatch(r"(\w+)\.(\w+)", ref):
                owner, name = m.groups()
                ok = (
                    _class_has(classes, owner, name)
                    if owner in classes
                    else name in modules.get(owner, every)
                )
            elif re.fullmatch(r"\w+", ref) and ("_" in ref or (ref[:1].isupper() and len(ref) > 3)):
                ok = ref in every or ref in classes
            else:  # prose, an expression, a value: `N = B * R`, `fast`
                continue
            if not ok:
                unknown.append(f"{row.words[0]}: {quoted}")
    return unknown


def test_every_name_the_table_quotes_is_the_codes() -> None:
    assert not unknown_references(rows())


def test_architecture_names_every_module() -> None:
    """ARCHITECTURE's floors and "Where each concern lives" name every module by its path under ``seqgen_cli/``
    (a family file by its name, in the families table)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    unnamed = [
        path
        for path in package_sources()
        if not path.endswith(("__init__.py", "__main__.py"))
        and path not in text
        and not (path.startswith("models/families/") and f"`{Path(path).name}`" in text)
        and not ("/" not in path and re.search(rf"\b{re.escape(path)}\b", text))
    ]
    assert not unnamed, unnamed


# -- the checker can fail ------------------------------------------------------------------------------------------

SYNTHETIC = """| word | means | not | names in code |
| --- | --- | --- | --- |
| *engine* | the decode loop (`Engine`) | a backend | `engine` only in `search/engine.py` |
| *step* | one token per row | detokenising | `decode` only in `models/fast.py` |
| *t* | the step counter | a position | never `rounds` |
| *gizmo* | a word no code or doc uses | - | - |
"""


def test_a_broken_rule_and_a_stale_word_are_found() -> None:
    table = words_table("## Words\n\n" + SYNTHETIC + "\n## Next\n")
    engine, step, t, _ = (row.rule for row in table)
    assert engine == Rule(("engine",), ("search/engine.py",)) and t == Rule(("rounds",))
    sources = {
        "generator.py": "class Generator:\n    def _engine(self, engine=None):\n        self.rounds = 0\n"
        "    def decode(self, seqs):\n        return seqs\n",
        "search/engine.py": "class Engine:\n    def run(self, engine):\n        pass\n",
        "models/fast.py": "class FastBackend:\n    def decode(self, state, tokens): ...\n",
        "models/linear_maps.py": "INT8_ENGINES = {}\nimport torch as engine_lib\n",
    }
    assert violations(engine, sources) == [
        "generator.py:2 _engine",
        "generator.py:2 engine",
        "models/linear_maps.py:1 INT8_ENGINES",
        "models/linear_maps.py:2 engine_lib",
    ]
    assert violations(step, sources) == ["generator.py:4 decode"]
    assert violations(t, sources) == ["generator.py:3 rounds"]
    assert stale_words(table, "class Engine: ...  # one step, t", "") == ["gizmo"]
    assert parts("use_int8_engine") == ["use", "int8", "engine"] and not built_on("DecoderOnly", "decode")


def test_a_stale_reference_is_found() -> None:
    table = [
        Row(
            ("detokenise",),
            "(`Generator.decode`, `outputs.Detokenise`, `models/gone.py`, `--no-such`)",
            "",
            None,
        )
    ]
    assert unknown_references(table) == [
        "detokenise: Generator.decode",
        "detokenise: models/gone.py",
        "detokenise: --no-such",
    ]
