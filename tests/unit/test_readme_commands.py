"""Every ``oomguard ...`` command line in the code blocks of README.md and docs/ goes through the real
parser, so they cannot drift from the CLI: a form they show must parse (and, for ``run``, validate).
The wrapping forms users copy live in docs/forms.md; the README keeps one."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from oomguard.supervisor.cli import build_parser
from oomguard.supervisor.config import build_config
from oomguard.supervisor.ops import systemd

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FORMS = ROOT / "docs" / "forms.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_WORD = re.compile(r"^[a-z][a-z-]*$")
ABBREVIATED = "<abbreviated>"  # the end of an argv whose options were left out with "..."


def _subcommands() -> set[str]:
    """The subcommands the real parser has (others add theirs to cli.EXTRA_COMMANDS)."""
    return {name for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


def _logical_lines(block: str) -> list[str]:
    """The block's lines with ``\\`` continuations joined."""
    out: list[str] = []
    pending = ""
    for raw in block.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        out.append(line)
    return out + ([pending] if pending else [])


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """As ``cli.main`` does: the options, and the training command after the first ``--``."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def _commands(text: str) -> list[list[str]]:
    """``oomguard SUBCOMMAND ...`` argv lists, wherever on a line they start (``docker exec train
    oomguard status ...``). A usage synopsis (``[--opt N]``) is not a command; ``...`` stands for
    "more of the user's own arguments" and is dropped; among oomguard's own options it stands for
    options shown in full elsewhere, and the argv then ends in ``ABBREVIATED`` (parsed, not validated)."""
    found: list[list[str]] = []
    known = _subcommands()
    for block in _FENCE.findall(text):
        for line in _logical_lines(block):
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue
            for i, token in enumerate(tokens[:-1]):
                # a line that starts with oomguard is a command (an unknown subcommand must fail);
                # inside a line (docker exec train oomguard status) only a known subcommand is one
                nxt = tokens[i + 1]
                if token == "oomguard" and (nxt in known or i == 0 and _WORD.match(nxt)):
                    options, _ = _split(tokens[i + 1:])
                    argv = [t for t in tokens[i + 1:] if t != "..."]
                    if not any(t.startswith("[") for t in argv):
                        found.append(argv + ([ABBREVIATED] if "..." in options else []))
                    break
    return found


COMMANDS = _commands(README.read_text())
DOC_COMMANDS = [(doc.name, argv) for doc in DOCS for argv in _commands(doc.read_text())]


def _parse(argv: list[str]) -> argparse.Namespace | None:
    """The real parser's reading; None for ``--help`` (which prints and exits 0)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in argv or "-h" in argv):
            return None
        raise AssertionError(f"oomguard {' '.join(argv)} does not parse (exit {exc.code})") from None


def _check_run(argv: list[str], command: list[str]) -> None:
    args = _parse(argv)
    if args is None:
        return
    options = {k: v for k, v in vars(args).items() if k not in ("func", "subcommand")}
    if not options.get("config"):  # a TOML file the README only names cannot be read here
        build_config(options, command)


def test_the_forms_page_has_the_forms_users_copy() -> None:
    forms = _commands(FORMS.read_text())
    joined = [" ".join(c) for c in forms]
    assert any("--resume-args=--init_from=resume" in c or "--init_from=resume" in c for c in joined), joined
    assert sum(c[0] == "run" for c in forms) >= 3


def test_the_readme_wraps_one_script_and_watches_a_recovery() -> None:
    """The README keeps one wrapped script and the CPU-only recovery, each an ``oomguard run`` with the
    placeholders a script is given."""
    runs = [" ".join(c) for c in COMMANDS if c[0] == "run"]
    assert len(runs) >= 2, runs
    assert all("{micro_batch}" in c and "{grad_accum}" in c and " -- " in c for c in runs), runs
    assert any("examples/train_argparse.py" in c and "--memory-budget-mb" in c for c in runs), runs


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_readme_command_parses(argv: list[str]) -> None:
    _check(argv)


@pytest.mark.parametrize("argv", [argv for _, argv in DOC_COMMANDS],
                         ids=[f"{doc}: {' '.join(argv)[:50]}" for doc, argv in DOC_COMMANDS])
def test_docs_command_parses(argv: list[str]) -> None:
    _check(argv)


def _check(argv: list[str]) -> None:
    if argv[-1] == ABBREVIATED:  # options left out on purpose: the parser must take what is shown
        _parse(_split(argv[:-1])[0])
        return
    options, command = _split(argv)
    if options[0] == "service":  # oomguard service [opts] -- RUN OPTIONS -- COMMAND
        args = _parse(options)
        assert args is None or args.func is not None
        run_options, run_command = _split(systemd.run_args(command))
        _check_run(["run", *run_options], run_command)
        return
    if options[0] == "run":
        _check_run(options, command)
        return
    _parse(options)


@pytest.mark.parametrize("form", [
    ["--resume-args", "--init_from=resume"],
    ["--resume-args=--init_from=resume"],
    ["--resume-args", "--resume_from_step={checkpoint_step}"],
])
def test_fragment_options_take_dashed_values(form: list[str]) -> None:
    argv = ["run", "--micro-batch", "4", "--grad-accum", "2", *form,
            "--fallback-args", "--gradient-checkpointing", "--fallback-args=--no-compile --x 1"]
    args = build_parser().parse_args(argv)
    assert args.resume_args.startswith("--")
    assert args.fallback_args == ["--gradient-checkpointing", "--no-compile --x 1"]
    config = build_config({k: v for k, v in vars(args).items() if k not in ("func", "subcommand")},
                          ["python", "train.py"])
    assert config.checkpoints.resume_args == form[-1].removeprefix("--resume-args=")
