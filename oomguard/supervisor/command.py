"""The user's training command as a template: its ``{micro_batch}``-style placeholders (and
``--resume-args``), how it hands the script its accumulation, and the ``--edit`` copies of its
config files. The typed config (``config.py``) checks it at start and the loop renders it for every
attempt, so it sits below both.

Tested in tests/unit/supervisor/test_command.py.
"""

from __future__ import annotations

import enum
import io
import json
import os
import re
import shlex
import shutil
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record.journal import write_atomic

NAMES = ("micro_batch", "grad_accum", "grad_accum_total", "global_batch", "world_size", "checkpoint",
         "checkpoint_step", "attempt", "run_dir", "eval_micro_batch", "num_workers")

_FORMATTER = string.Formatter()


def check_template(text: str) -> None:
    """Raise UsageError for an unknown ``{name}`` or unbalanced braces (``{{``/``}}`` are literal)."""
    try:
        fields = [name for _, name, _, _ in _FORMATTER.parse(text) if name is not None]
    except ValueError as exc:
        raise UsageError("COMMAND", f"bad braces in {text!r} ({exc})",
                         "write {{ and }} for literal braces") from None
    for name in fields:
        if name not in NAMES:
            raise UsageError("COMMAND", f"unknown placeholder {{{name}}} in {text!r}",
                             "use one of " + ", ".join("{" + n + "}" for n in NAMES))


def used(texts: Iterable[str]) -> set[str]:
    """The placeholder names that occur in ``texts`` (checked templates)."""
    return {name for text in texts for _, name, _, _ in _FORMATTER.parse(text) if name}


def render(text: str, values: Mapping[str, object]) -> str:
    """Substitute the placeholders; ``text`` was checked at start, so this cannot fail."""
    return text.format_map({name: "" if values.get(name) is None else values[name] for name in NAMES})


# The program a command runs behind the wrappers that only set its limits, priority or placement.
#
# ``prlimit --as=1250000000 python train.py``, ``env A=1 python train.py``, ``nice -n 5 ...``,
# ``taskset -c 0-3 ...``, ``numactl --cpunodebind=0 ...``, ``timeout 2h ...`` and ``bash -c "python
# train.py"`` all run ``python train.py`` in a process of the worker's tree, where the probe loads
# (it is on the PYTHONPATH every process inherits). ``unwrap`` returns that inner command, for what is
# judged from the program the command runs (is it Python, which script). Pure: words in, words out.


SHELLS = frozenset({"sh", "bash", "dash", "zsh"})
# Each wrapper, and its options that take the next word as their value (``-n 5``); ``--opt=value``
# and flags are one word. ``positional``: the words the wrapper itself takes before the command
# (taskset's mask, timeout's duration, chrt's priority).
_VALUED = {
    "env": {"-u", "--unset", "-C", "--chdir"},
    "nice": {"-n", "--adjustment"},
    "prlimit": {"-o", "--output"},
    "taskset": set(),
    "numactl": {"-C", "-N", "-m", "-i", "-p", "-P", "-w", "--cpunodebind", "--membind", "--physcpubind",
                "--interleave", "--preferred", "--preferred-many", "--weighted-interleave"},
    "ionice": {"-c", "--class", "-n", "--classdata"},
    "chrt": {"-T", "--sched-runtime", "-P", "--sched-period", "-D", "--sched-deadline"},
    "stdbuf": {"-i", "-o", "-e", "--input", "--output", "--error"},
    "timeout": {"-s", "--signal", "-k", "--kill-after"},
    "time": {"-f", "--format", "-o", "--output"},
    "nohup": set(), "setsid": set(), "exec": set(), "command": set(),
}
_POSITIONAL = {"taskset": 1, "timeout": 1, "chrt": 1}
# Options that make the wrapper act on another process (``prlimit --pid 42``): no command follows.
_OTHER_PROCESS = {"-p", "--pid"}
_SHELL_OPERATORS = frozenset({"&&", "||", ";", "|", "&"})


def unwrap(command: Sequence[str]) -> list[str]:
    """The command the wrappers run (the command itself when it has none); ``bash -c "..."`` is the
    last command of its string (``cd x && python train.py``). Unchanged where it cannot be told."""
    words = list(command)
    for _ in range(16):  # wrappers nest (``nice -n 5 prlimit --as=... python``); a bound, not a budget
        inner = _one_level(words)
        if not inner:
            return words
        words = inner
    return words


def not_python(command: list[str] | tuple[str, ...]) -> str | None:
    """Why the command (behind its wrappers) is not a Python program, or None when it is or cannot be
    told; a shell script may still start Python, whose processes get the probe all the same."""
    argv = unwrap(command)
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name.startswith(("python", "pypy")) or name.endswith(".py") or name in SHELLS:
        return None
    path = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
    try:
        with open(path or argv[0], "rb") as script:
            first = script.readline(256)
    except OSError:
        return None
    if first.startswith(b"#!") and b"python" in first:
        return None  # torchrun, accelerate, a console script
    return f"the command ({name}) is not Python"


def _one_level(words: list[str]) -> list[str] | None:
    """The words one wrapper runs, or None when ``words`` starts with no wrapper."""
    if not words:
        return None
    name = os.path.basename(words[0])
    if name in SHELLS:
        return _shell_string(words[1:])
    if name not in _VALUED:
        return None
    valued, wanted = _VALUED[name], _POSITIONAL.get(name, 0)
    i = 1
    while i < len(words):
        word = words[i]
        if word == "--":
            return words[i + 1:]
        if name in ("prlimit", "taskset", "chrt", "ionice") and word.split("=")[0] in _OTHER_PROCESS:
            return None
        if name == "env" and "=" in word and not word.startswith("-"):
            i += 1  # NAME=value
        elif word.startswith("-") and word != "-":
            i += 2 if word in valued else 1
        elif wanted:
            wanted, i = wanted - 1, i + 1
        else:
            return words[i:]
    return None


def _shell_string(args: list[str]) -> list[str] | None:
    """``-c "string"``: the last command of the string; a script file or an interactive shell: None."""
    if len(args) < 2 or args[0] != "-c":
        return None
    try:
        words = shlex.split(args[1])
    except ValueError:  # an unbalanced quote: the shell will say so
        return None
    last: list[str] = []
    for word in words:
        last = [] if word in _SHELL_OPERATORS else [*last, word]
    return last or None


# How the training command hands the script its gradient accumulation, read once at start.
#
# oomguard keeps ``global = micro × accumulation × world`` only where the script is told the
# accumulation. ``carrier`` says how it is told:
#
# - a placeholder: ``{grad_accum}`` (per rank) or ``{grad_accum_total}`` (summed over the ranks, for
#   scripts that divide by the world size as nanoGPT does), in the command, ``--resume-args``,
#   ``--fallback-args`` or an ``--edit``;
# - the environment: the command reads ``$OOMGUARD_GRAD_ACCUM`` (or ``$OOMGUARD_GLOBAL_BATCH``);
# - derived by the script from a total it is given: ``{global_batch}``, or nanochat's
#   ``--total_batch_size`` (the script computes its own accumulation from it);
# - none: the command passes ``{micro_batch}`` and nothing else. Then a smaller micro-batch is a
#   smaller global batch, and oomguard says so at start instead of claiming the global batch is kept;
# - unseen: no ``{micro_batch}`` either: the script reads the whole plan from the environment (the
#   worker library).
#
# ``total_warning`` is the other way to get it wrong: a script that divides the accumulation it is
# given by the world size (nanoGPT's ``gradient_accumulation_steps //= ddp_world_size``) handed the
# per-rank ``{grad_accum}`` trains at a global batch ``world`` times too small.


ACCUMULATION = ("grad_accum", "grad_accum_total")
ENV_NAMES = ("OOMGUARD_GRAD_ACCUM", "OOMGUARD_GLOBAL_BATCH")
# Flags whose script derives its accumulation from a total it is given (nanochat's base_train).
TOTAL_FLAGS = ("total_batch_size",)
_SOURCE_LIMIT = 1 << 20  # the script's first MiB is read for the division; enough for any train.py
# ``gradient_accumulation_steps //= ddp_world_size`` (nanoGPT), ``x = x // int(os.environ["WORLD_SIZE"])``
_DIVIDES = re.compile(r"^[ \t]*(?P<name>[A-Za-z_][\w.]*)\s*(?://=|=\s*(?P=name)\s*//)[^\n#]*world_size",
                      re.IGNORECASE | re.MULTILINE)


class Carrier(enum.Enum):
    """How the script learns its accumulation (see the module's docstring)."""

    PLACEHOLDER = "placeholder"
    ENVIRONMENT = "environment"
    DERIVED = "derived"
    NONE = "none"
    UNSEEN = "unseen"


def carrier(texts: Sequence[str]) -> Carrier:
    """How the command's words, --resume-args, --fallback-args and --edit values hand over the accumulation."""
    names = used(texts)
    if names & set(ACCUMULATION):
        return Carrier.PLACEHOLDER
    if any(name in text for text in texts for name in ENV_NAMES):
        return Carrier.ENVIRONMENT
    if "global_batch" in names or any(_flag_name(word) in TOTAL_FLAGS for word in texts):
        return Carrier.DERIVED
    return Carrier.NONE if "micro_batch" in names else Carrier.UNSEEN


def no_accumulation_line(micro_batch: int, world_size: int, allowed: bool) -> str:
    """The one line said at start for a command that passes {micro_batch} and no accumulation."""
    first = (f"the command passes {{micro_batch}} but no {{grad_accum}}: the script cannot accumulate, so its "
             f"global batch is micro × world = {micro_batch * world_size}, and a halving will shrink it")
    if allowed:
        return first + " (--allow-smaller-global-batch: shown as '= N (asked M)' everywhere)"
    return first + ("; oomguard will not halve it without --allow-smaller-global-batch (or put {grad_accum} where "
                    "the script takes its accumulation)")


def total_warning(command: Sequence[str], program: Sequence[str] | None, cwd: Path, grad_accum: int,
                  world_size: int, micro_batch: int) -> str | None:
    """A line when the script divides an accumulation flag by the world size (it takes the total,
    as nanoGPT does) and the command gives that flag the per-rank ``{grad_accum}``; else None."""
    if world_size < 2 or not program:
        return None
    script = _script_path(program, cwd)
    if script is None:
        return None
    divided = _divided_names(script)
    for flag, value in _flag_values(command):
        if flag.lower() in divided and "grad_accum" in used([value]):
            per_rank = grad_accum // world_size
            effect = (f"{grad_accum} does not divide by the world size {world_size} (nanoGPT stops at its assert)"
                      if grad_accum % world_size else
                      f"each rank would accumulate {per_rank}, not {grad_accum}, and train at a global batch of "
                      f"{micro_batch * per_rank * world_size}, not {micro_batch * grad_accum * world_size}")
            return (f"{script.name} divides --{flag} by the world size (as nanoGPT does) but is given the per-rank "
                    f"{{grad_accum}}: {effect}; pass --{flag}={{grad_accum_total}}")
    return None


def _flag_name(word: str) -> str:
    return word.lstrip("-").partition("=")[0].replace("-", "_") if word.startswith("--") else ""


def _flag_values(command: Sequence[str]) -> list[tuple[str, str]]:
    """(flag name with underscores, its value) for ``--flag=value`` and ``--flag value``."""
    out = []
    for i, word in enumerate(command):
        name = _flag_name(word)
        if not name:
            continue
        if "=" in word:
            out.append((name, word.partition("=")[2]))
        elif i + 1 < len(command) and not command[i + 1].startswith("--"):
            out.append((name, command[i + 1]))
    return out


def _script_path(program: Sequence[str], cwd: Path) -> Path | None:
    """The script file python is given (its options skipped); None for ``-m`` or none found."""
    words = list(program)
    while words and words[0].startswith("-") and words[0] != "-m":
        words.pop(0)  # python's own switches (-u, -O, ...)
    if not words or words[0] == "-m":
        return None
    path = cwd / words[0]
    return path if path.is_file() else None


def _divided_names(script: Path) -> set[str]:
    """The variables the script divides by the world size, by their last name (``args.x`` -> x)."""
    try:
        with open(script, encoding="utf-8", errors="replace") as fh:
            source = fh.read(_SOURCE_LIMIT)
    except OSError:
        return set()
    return {match["name"].rpartition(".")[2].lower() for match in _DIVIDES.finditer(source)}


# ``--edit FILE:KEY=VALUE``: the batch sizes of scripts that read them from a config file.
#
# Each attempt gets a copy of FILE in the run directory with the keys set (dotted keys reach into
# nested tables, placeholders in VALUE are filled), and the command's argument that names FILE is
# pointed at the copy. The user's file is only ever read. YAML keeps its comments, order and quoting
# (ruamel.yaml's round-trip mode), TOML its comments and layout (tomlkit); JSON keeps key order.


FORMATS = {".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml"}


@dataclass(frozen=True)
class Edit:
    file: str  # as the user wrote it (and as the command names it)
    key: str  # dotted: train.micro_batch_size
    value: str  # may hold placeholders


def parse_edit(spec: str) -> Edit:
    """``FILE:KEY=VALUE``; the value may itself hold ``:`` and ``=``."""
    head, eq, value = spec.partition("=")
    file, colon, key = head.rpartition(":")
    if not eq or not colon or not file or not key or any(not k for k in key.split(".")):
        raise UsageError("--edit", f"{spec!r} is not FILE:KEY=VALUE",
                         "e.g. --edit 'configs/x.yaml:train.micro_batch_size={micro_batch}'")
    if Path(file).suffix.lower() not in FORMATS:
        raise UsageError("--edit", f"{file} is not a .yaml, .yml, .json or .toml file", "edit one of those")
    return Edit(file, key, value)


# --- reading and writing the three formats ---------------------------------------------------------


def _yaml() -> Any:
    """ruamel.yaml in round-trip mode: comments (at their columns), key order and quotes survive."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    return yaml


def _load(path: Path) -> Any:
    text = path.read_text()
    kind = FORMATS[path.suffix.lower()]
    if kind == "yaml":
        return _yaml().load(text)
    if kind == "toml":
        import tomlkit

        return tomlkit.parse(text)
    return json.loads(text)


def _dump(doc: Any, path: Path) -> str:
    kind = FORMATS[path.suffix.lower()]
    if kind == "yaml":
        out = io.StringIO()
        _yaml().dump(doc, out)
        return out.getvalue()
    if kind == "toml":
        import tomlkit

        return tomlkit.dumps(doc)
    return json.dumps(doc, indent=2) + "\n"


def load_checked(path: Path, option_spec: str) -> Any:
    """The parsed file, or one line (exit 2) when it cannot be read or parsed."""
    try:
        return _load(path)
    except OSError as exc:
        raise UsageError("--edit", f"cannot read {path}: {exc.strerror}", "check the path in " + option_spec) from None
    except Exception as exc:  # each parser has its own error types; all mean "does not parse"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError("--edit", f"{path} does not parse ({first})", "fix the file") from None


def _parent(doc: Any, edit: Edit) -> tuple[Any, Any]:
    """The container holding the edited key, and the key (an int for a list index)."""
    node = doc
    parts = edit.key.split(".")
    for depth, part in enumerate(parts):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            key: Any = int(part)
        elif isinstance(node, Mapping) and part in node:
            key = part
        else:
            where = ".".join(parts[:depth + 1])
            raise UsageError("--edit", f"{edit.file} has no key {where!r}",
                             "check the key (dotted for nesting, e.g. train.micro_batch_size)")
        if depth == len(parts) - 1:
            return node, key
        node = node[key]
    raise UsageError("--edit", f"empty key in {edit.file}", "give a key")


def _typed(text: str, current: Any) -> Any:
    """VALUE as the file should hold it: a number, true/false or null where it reads as one (JSON
    syntax), but a string where the file had a string."""
    if isinstance(current, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


# --- what the loop calls -----------------------------------------------------------------------------


def check_edits(specs: Sequence[str], command: Sequence[str], cwd: Path) -> list[Edit]:
    """Every spec well-formed, its file parsed, its key present and the file named by the command."""
    edits = [parse_edit(spec) for spec in specs]
    for edit, spec in zip(edits, specs, strict=True):
        path = cwd / edit.file
        _parent(load_checked(path, spec), edit)
        if not any(_names(token, path, cwd) is not None for token in command):
            raise UsageError("--edit", f"no argument of the command names {edit.file}",
                             f"pass the file to the script, e.g. --config {edit.file}")
    return edits


def _names(token: str, path: Path, cwd: Path) -> str | None:
    """The prefix before the file name when ``token`` names ``path``: ``""`` for ``cfg.yaml``,
    ``"--config="`` for ``--config=cfg.yaml``; None when it does not name it."""
    splits = [("", token)] + [(token[:i + 1], token[i + 1:]) for i, c in enumerate(token) if c == "="]
    for prefix, rest in splits:
        if rest and _same(cwd / rest, path):
            return prefix
    return None


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


def apply_edits(edits: Sequence[Edit], argv: Sequence[str], values: Mapping[str, object], cwd: Path,
                out_dir: Path) -> list[str]:
    """Write this attempt's copies under ``out_dir`` and return the argv pointed at them."""
    by_file: dict[str, list[Edit]] = {}
    for edit in edits:
        by_file.setdefault(edit.file, []).append(edit)
    result = list(argv)
    for file, group in by_file.items():
        path = cwd / file
        doc = _load(path)
        for edit in group:
            node, key = _parent(doc, edit)
            node[key] = _typed(render(edit.value, values), node[key])
        copy = write_atomic(out_dir / path.name, _dump(doc, path))  # a worker that starts reads a whole file
        result = [(prefix + str(copy)) if (prefix := _names(t, path, cwd)) is not None else t for t in result]
    return result
