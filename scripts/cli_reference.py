"""Write the command-line reference, docs/CLI.md, from the click commands themselves:

    python scripts/cli_reference.py > docs/CLI.md

tests/test_cli_reference.py holds docs/CLI.md equal to this script's output, so a changed option, default or
help text fails the tests until the file is regenerated. The text is built from click's Parameter objects
(declarations, metavar, default, range, help), never from the wrapped ``--help`` output, so it does not depend on
the terminal's width.
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without the package installed
    sys.path.insert(0, str(REPO))

from seqgen_cli.cli import HELP_SECTIONS, _SectionedCommand, main  # noqa: E402

COMMAND = "python scripts/cli_reference.py > docs/CLI.md"
HEADER = f"""# seqgen command-line reference

Generated from the click commands: after changing an option or its help text in `seqgen_cli/cli.py`, regenerate
it (never edit it by hand; `tests/test_cli_reference.py` fails while the two differ) with

```bash
{COMMAND}
```

`seqgen COMMAND --help` (or `-h`) prints the same text. How and why, by task: [GUIDE.md](GUIDE.md).
"""

# Markdown's inline specials, escaped in help text outside `code spans`: `length**penalty` stays as written and
# `SCORE<TAB>` is not read as an HTML tag. An underscore inside a word (forced_bos_token_id) is not emphasis.
_SPECIAL = re.compile(r"([\\*<\[\]])|(?<!\w)_|_(?!\w)")


def _escape(text: str) -> str:
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else _SPECIAL.sub(lambda m: "\\" + m.group(0), p) for p in parts)


def _help_text(text: str | None) -> str:
    """A command's docstring as click cleans it, in Markdown: paragraphs as written, a ``\\b`` paragraph (kept
    unwrapped by click: the examples) as a code block."""
    if not text:
        return ""
    blocks = []
    for para in inspect.cleandoc(text).partition("\f")[0].split("\n\n"):
        lines = para.splitlines()
        if lines and lines[0].strip() == "\b":
            blocks.append("```text\n" + textwrap.dedent("\n".join(lines[1:])) + "\n```")
        else:
            blocks.append(_escape(para))
    return "\n\n".join(blocks) + "\n"


def _metavar(param: click.Option) -> str:
    if param.is_flag and not param.count:
        return ""
    if param.metavar is not None:
        return param.metavar
    if isinstance(param.type, click.Choice):
        return "[" + "|".join(str(c) for c in param.type.choices) + "]"
    return param.type.name.upper().replace(" RANGE", "")


def _declarations(param: click.Option) -> str:
    decl = ", ".join(param.opts)
    if param.secondary_opts:
        decl += " / " + ", ".join(param.secondary_opts)
    metavar = _metavar(param)
    return f"{decl} {metavar}" if metavar else decl


def _range(param: click.Option) -> str | None:
    kind = param.type
    if not isinstance(kind, click.IntRange | click.FloatRange):
        return None
    low = None if kind.min is None else f"{kind.min}{'<' if kind.min_open else '<='}"
    high = None if kind.max is None else f"{'<' if kind.max_open else '<='}{kind.max}"
    if low is not None and high is None:  # as click writes it: x>=1, not 1<=x
        return f"x{'>' if kind.min_open else '>='}{kind.min}"
    return f"{low or ''}x{high or ''}"


def _default(param: click.Option, ctx: click.Context) -> str | None:
    """The default as ``--help`` shows it: only where the option asks for it (``show_default``)."""
    show = param.show_default if param.show_default is not None else ctx.show_default
    if not show:
        return None
    if isinstance(show, str):
        return show
    value = param.get_default(ctx, call=True)
    if value is None:
        return None
    if param.is_flag and param.secondary_opts:  # a --x/--no-x switch: the form that is the default
        return (param.opts if value else param.secondary_opts)[-1]
    if param.is_flag:
        return None if value is False else "on"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def _option(param: click.Option, ctx: click.Context) -> str:
    notes = []
    if param.required:
        notes.append("Required.")
    if (default := _default(param, ctx)) is not None:
        notes.append(f"Default: `{default}`.")
    if (span := _range(param)) is not None:
        notes.append(f"Range: `{span}`.")
    if param.multiple and "repeatable" not in (param.help or "").lower():
        notes.append("Repeatable.")
    text = " ".join([_escape(param.help or ""), *notes]).strip()
    return f"- `{_declarations(param)}`" + (f" — {text}" if text else "")


def _options(command: click.Command, ctx: click.Context) -> list[str]:
    """The options, in ``--help``'s order; ``seqgen generate``'s under its help sections."""
    params = [
        p
        for p in command.get_params(ctx)
        if isinstance(p, click.Option) and not p.hidden and not set(p.opts) & set(ctx.help_option_names)
    ]
    if not params:
        return []
    if not isinstance(command, _SectionedCommand):
        return ["### Options", "", *(_option(p, ctx) for p in params), ""]
    sections: dict[str, list[click.Option]] = {}
    for p in params:
        name = next((s for s, names in HELP_SECTIONS.items() if p.name in names), "Other")
        sections.setdefault(name, []).append(p)
    out = []
    for name in [*HELP_SECTIONS, "Other"]:
        if name in sections:
            out += [f"### {name}", "", *(_option(p, ctx) for p in sections[name]), ""]
    return out


def render() -> str:
    """docs/CLI.md: the group, then every command in the order the code defines them."""
    root = click.Context(main, info_name="seqgen", **main.context_settings)
    lines = [HEADER]
    lines += ["## `seqgen`", "", "```text", f"seqgen {' '.join(main.collect_usage_pieces(root))}", "```", ""]
    lines += [
        _help_text(main.help),
        "Commands: " + ", ".join(f"[`{n}`](#seqgen-{n})" for n in main.commands),
        "",
    ]
    lines += _options(main, root)
    for name, command in main.commands.items():
        ctx = click.Context(command, info_name=name, parent=root, **command.context_settings)
        usage = f"{ctx.command_path} {' '.join(command.collect_usage_pieces(ctx))}"
        lines += [f"## `seqgen {name}`", "", "```text", usage, "```", "", _help_text(command.help)]
        lines += _options(command, ctx)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
