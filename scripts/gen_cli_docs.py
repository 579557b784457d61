"""Write docs/cli.md from oomguard's argparse parser, so the CLI reference cannot drift from the CLI.

    python scripts/gen_cli_docs.py           # rewrite docs/cli.md
    python scripts/gen_cli_docs.py --check   # exit 1 with one line if docs/cli.md is out of date

It walks ``oomguard.supervisor.cli.build_parser()`` and every subcommand registered on it and writes,
for each, the usage line, the description and a table of options (flags, default, help).
tests/unit/test_docs.py calls ``render()`` in-process and compares, so CI fails when an option changes and
this script was not re-run. The output depends only on the parser: usage lines are formatted here,
not by argparse, so neither the terminal's width nor the Python version changes them.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "cli.md"
WIDTH = 100  # usage lines wrap here, whatever the terminal says

# main() splits argv at the first "--" before argparse sees it; what follows is the training command.
AFTER_DASHES = {"oomguard run": "COMMAND [ARGS...]"}

# The help that ``RunConfig``'s options carry ends in "(default: X)"; the table has a column for it.
_DEFAULT_IN_HELP = re.compile(r"\s*\(default: ([^()]*)\)\s*$")
_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction)
_NO_ROW = (argparse._HelpAction, argparse._SubParsersAction)


@dataclass(frozen=True)
class Command:
    """One parser in the tree: its full name (``oomguard run``), the parser and its one-line help."""

    name: str
    parser: argparse.ArgumentParser
    help: str


def load_parser() -> argparse.ArgumentParser:
    """The real CLI's parser; the repository root is a fallback for an uninstalled checkout."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from oomguard.supervisor.cli import build_parser

    return build_parser()


def commands(parser: argparse.ArgumentParser, name: str = "oomguard", help: str = "") -> Iterator[Command]:
    """The parser and its subcommands, depth first, in the order they were registered."""
    yield Command(name, parser, help)
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        seen: set[int] = set()
        for sub_name, sub in action.choices.items():
            if id(sub) in seen:  # an alias of a command already listed
                continue
            seen.add(id(sub))
            yield from commands(sub, f"{name} {sub_name}", helps.get(sub_name, ""))


def _metavar(action: argparse.Action) -> str:
    if isinstance(action.metavar, tuple):
        return " ".join(action.metavar)
    if action.metavar is not None:
        return action.metavar
    return action.dest if not action.option_strings else action.dest.upper()


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _usage_token(action: argparse.Action) -> str:
    if isinstance(action, argparse._SubParsersAction):
        return "COMMAND ..."
    if not action.option_strings:
        if action.nargs == argparse.REMAINDER:
            return f"-- {_metavar(action).upper()}..."
        name = _metavar(action)
        return {"*": f"[{name} ...]", "+": f"{name} [{name} ...]", "?": f"[{name}]"}.get(str(action.nargs), name)
    flag = action.option_strings[-1]  # the long form reads best in a synopsis
    token = f"{flag} {_metavar(action)}" if _takes_value(action) else flag
    return token if action.required else f"[{token}]"


def usage(command: Command) -> str:
    """The synopsis, wrapped at WIDTH with continuation lines under the first option."""
    tokens = [_usage_token(a) for a in command.parser._actions if not isinstance(a, argparse._HelpAction)]
    if command.name in AFTER_DASHES:
        tokens.append(f"-- {AFTER_DASHES[command.name]}")
    lines = [command.name]
    indent = " " * (len(command.name) + 1)
    for token in tokens:
        if len(lines[-1]) + 1 + len(token) > WIDTH and lines[-1].strip():
            lines.append(indent + token)
        else:
            lines[-1] += " " + token
    return "\n".join(lines)


def _split_help(action: argparse.Action, prog: str) -> tuple[str, str]:
    """(help without a trailing "(default: X)", X or "")."""
    if not action.help or action.help == argparse.SUPPRESS:
        return "", ""
    text = argparse.HelpFormatter(prog)._expand_help(action)  # %(default)s and %% as argparse does
    match = _DEFAULT_IN_HELP.search(text)
    if match:
        return text[: match.start()], match.group(1)
    return text, ""


def _default(action: argparse.Action, from_help: str) -> str:
    if isinstance(action, _SWITCHES):
        return "off"
    if from_help:
        return from_help
    if action.default in (None, argparse.SUPPRESS, False, [], ()):
        return ""
    return str(action.default)


def _cell(text: str) -> str:
    """Markdown for a table cell: pipes escaped; outside `code`, < > * escaped too."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "`".join(parts)


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{_usage_token(action)}`"
    if not _takes_value(action):
        return ", ".join(f"`{flag}`" for flag in action.option_strings)
    return ", ".join(f"`{flag} {_metavar(action)}`" for flag in action.option_strings)


def options_table(command: Command) -> list[str]:
    rows = []
    for action in command.parser._actions:
        if isinstance(action, _NO_ROW):
            continue
        text, from_help = _split_help(action, command.name)
        default = _default(action, from_help)
        rows.append(f"| {_flags(action)} | {_cell(f'`{default}`') if default else ''} | {_cell(text)} |")
    if not rows:
        return []
    return ["| option | default | meaning |", "| --- | --- | --- |", *rows, ""]


def _section(command: Command) -> list[str]:
    lines = [f"## `{command.name}`", "", "```text", usage(command), "```", ""]
    description = command.parser.description or command.help
    if description:
        lines += [_cell(description), ""]
    return lines + options_table(command)


def _anchor(name: str) -> str:
    return "#" + name.replace(" ", "-")


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/cli.md's text for ``parser`` (default: the real CLI's)."""
    tree = list(commands(parser if parser is not None else load_parser()))
    top, subs = tree[0], tree[1:]
    lines = [
        "# Command-line reference",
        "",
        "<!-- Generated by scripts/gen_cli_docs.py from oomguard.supervisor.cli.build_parser(); do not edit.",
        "     After changing an option run `python scripts/gen_cli_docs.py`; tests/unit/test_docs.py fails"
        " until then. -->",
        "",
        _cell(top.parser.description or ""),
        "",
        "```text",
        usage(top),
        "```",
        "",
    ]
    lines += options_table(top)
    if subs:
        lines += ["| command | what it does |", "| --- | --- |"]
        lines += [f"| [`{c.name}`]({_anchor(c.name)}) | {_cell(c.help or c.parser.description or '')} |" for c in subs]
        lines.append("")
    lines += [
        "Every command also takes `-h`/`--help`. Everything after the first `--` on the command line is not",
        "parsed as options: for `oomguard run` it is the training command, for `oomguard service` the",
        "arguments of the `oomguard run` that the unit will start. An option whose value itself starts with",
        "`--` is written with `=`: `--resume-args='--init_from=resume'`.",
        "",
    ]
    for command in subs:
        lines += _section(command)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    return os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else str(path)


def main(argv: Sequence[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description="Write docs/cli.md from oomguard's argparse parser.")
    cli.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is out of date; write nothing")
    args = cli.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{_shown(OUTPUT)} is out of date: run python scripts/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {_shown(OUTPUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
