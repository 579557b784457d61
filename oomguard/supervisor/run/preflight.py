"""Find at start what would otherwise fail at 3 a.m.: render every later attempt once, now.

The first restart is the first time ``--resume-args`` and the fallbacks are rendered: an unbalanced
quote there used to crash the supervisor hours in. ``check`` renders the command as a restart from a
checkpoint with every fallback applied would (a checkpoint path with spaces and quotes), builds its
environment, and checks that the command can be started, that the script and its settings files
exist, that a watched checkpoint reaches the script and that the batch does: each one line and
exit 2 before anything runs. ``notices`` are the lines said at start about forms that run but not
as a reader might think (no accumulation, nanoGPT's total, a short ``accelerate launch``).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path
from typing import NoReturn

from oomguard.common import protocol
from oomguard.supervisor.command import (
    SHELLS,
    Carrier,
    check_edits,
    no_accumulation_line,
    total_warning,
    used,
)
from oomguard.supervisor.config import RunConfig, add_arguments, build_config, fragment_flags, join_fragments
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.distributed import launcher, torchrun
from oomguard.supervisor.distributed.accelerate import AccelerateLaunch
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.run.process import AttemptFiles, build_argv, build_env, placeholder_values

# How the training command gets its checkpoint, and the files it names: checked at start.
#
# Two mistakes used to cost a night without a word. Checkpoints were watched (``--checkpoint``) but
# nothing handed them to the script, so every restart started over at step 1; and a script path
# with a typo (``python trian.py``) failed three times with backoff and then as a crash loop. Each is
# one line and exit 2 now, before anything runs.
#
# A way to hand the checkpoint over is any of: ``{checkpoint}`` or ``{checkpoint_step}`` in the
# command; ``--resume-args`` (nanoGPT's ``--init_from=resume`` names no path and still counts: it is
# how that script is told to resume); an ``--edit`` whose value uses a checkpoint placeholder; the
# worker library, seen in the script's source or the source of the user's own modules it imports
# (``import oomguard``, or the names ``OOMGUARD_CHECKPOINT``/``OOMGUARD_CHECKPOINT_STEP``); or the
# user's word that the script finds its checkpoint by itself (``--resumes-itself``). Source is read,
# never run: Python through ``ast``, other scripts as text.


CHECKPOINT_NAMES = frozenset({"checkpoint", "checkpoint_step"})
LIBRARY_ENV = frozenset({"OOMGUARD_CHECKPOINT", "OOMGUARD_CHECKPOINT_STEP"})
_PYTHON = re.compile(r"^(python|pypy)[0-9.]*$")
_PYTHON_VALUED = frozenset({"-W", "-X", "-Q"})  # the interpreter's options whose value is the next word
# A file a script reads its settings from: nanoGPT's ``config/train_gpt2.py``, ``--config x.yaml``.
CONFIG_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".toml", ".cfg", ".ini")
_CONFIG_OPTION = re.compile(r"^--?[\w.-]*(config|cfg|recipe|hparams)[\w.-]*$", re.IGNORECASE)
_MAX_SOURCES = 50  # the user's own modules read to find the worker library (a bound, not a budget)
_MAX_SOURCE_BYTES = 4 << 20  # of each: a source file is far smaller; a program on PATH may not be


@dataclass(frozen=True)
class Script:
    """What the command runs: a file (``python train.py``, ``./train.sh``) or a module (``-m pkg.train``)."""

    kind: str  # "file" (run by an interpreter), "program" (run itself) or "module"
    name: str  # as written in the command
    args: tuple[str, ...]  # the script's own arguments


# --- what the command runs --------------------------------------------------------------------


def script_of(command: Sequence[str]) -> Script | None:
    """The script the command runs (through torchrun, python, a shell or a launcher), or None."""
    if not command:
        return None
    launched = torchrun.parse(command)
    if launched is not None:
        if not launched.script:
            return None
        names = {name for name, _ in launched.options}
        kind = "module" if names & {"m", "module"} else "program" if "no-python" in names else "file"
        return Script(kind, launched.script[0], tuple(launched.script[1:]))
    program, rest = command[0], list(command[1:])
    if _PYTHON.match(Path(program).name):
        return _python_script(rest)
    if Path(program).name in SHELLS and rest and not rest[0].startswith("-"):
        return Script("file", rest[0], tuple(rest[1:]))
    if os.sep in program:  # ./train.sh: preflight checks that it exists and is executable
        return Script("program", program, tuple(rest))
    for i, word in enumerate(rest):  # accelerate launch train.py, deepspeed train.py, uv run train.py
        if word.endswith(".py") and not word.startswith("-"):
            return Script("file", word, tuple(rest[i + 1:]))
    return None


def is_interpreter(program: str) -> bool:
    """python, pypy or a shell: a program whose code is elsewhere (a file, ``-c``, ``-m``)."""
    name = Path(program).name
    return bool(_PYTHON.match(name)) or name in SHELLS


def _python_script(words: list[str]) -> Script | None:
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("-m"):  # -m pkg.mod or -mpkg.mod
            name = word[2:] or (words[i + 1] if i + 1 < len(words) else "")
            rest = words[i + 1:] if word[2:] else words[i + 2:]
            return Script("module", name, tuple(rest)) if name else None
        if word.startswith("-c") or word == "-":  # code on the command line or stdin: no file
            return None
        if word in _PYTHON_VALUED:
            i += 2
            continue
        if word.startswith("-"):  # -u, -O, -B, -Wignore, -Xdev
            i += 1
            continue
        return Script("file", word, tuple(words[i + 1:]))
    return None


# --- files that must exist ---------------------------------------------------------------------


def check_files(script: Script | None, cwd: Path) -> None:
    """The script and the settings files among its arguments exist (where no placeholder is in them)."""
    if script is None:
        return
    if script.kind == "file":
        _must_exist(script.name, cwd, "the script")
    for word in settings_files(script.args):
        _must_exist(word, cwd, "a file the command names")


def settings_files(args: Sequence[str]) -> Iterator[str]:
    """Arguments that name a settings file the script reads (``config/x.py``, ``x.yaml``, the value of
    ``--config``); an output file (``--output out.json``) need not exist yet."""
    previous: str | None = None
    for word in args:
        option, eq, value = word.partition("=")
        if word.startswith("-") and eq:
            if _CONFIG_OPTION.match(option) and value.endswith(CONFIG_SUFFIXES):
                yield value
            previous = None
        elif word.startswith("-"):
            previous = word
        else:
            if word.endswith(CONFIG_SUFFIXES) and "=" not in word:
                if previous is None or _CONFIG_OPTION.match(previous):
                    yield word
            previous = None


def _must_exist(word: str, cwd: Path, what: str) -> None:
    if "{" in word:  # rendered per attempt
        return
    path = cwd / word  # an absolute word stays itself
    if path.exists():
        return
    fix = "check the path" + (f": did you mean {guess}?" if (guess := _near(path, word)) else "")
    where = "" if os.path.isabs(word) else f" (in {cwd})"
    raise UsageError("COMMAND", f"{what} {word} does not exist{where}", fix)


def _near(path: Path, word: str) -> str | None:
    """The closest name in the same directory (``trian.py`` -> ``train.py``), as the user wrote it."""
    try:
        names = [p.name for p in path.parent.iterdir()]
    except OSError:
        return None
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.75)
    return os.path.join(os.path.dirname(word), close[0]) if close else None


# --- how the checkpoint reaches the script -------------------------------------------------------


def check_resume(config: RunConfig, script: Script | None, cwd: Path) -> None:
    """Checkpoints are watched only to be resumed from: something must hand them to the script."""
    if not config.checkpoints.globs or config.checkpoints.resumes_itself or config.checkpoints.resume_args:
        return
    if used([*config.command, *config.edit_values]) & CHECKPOINT_NAMES:
        return
    source = locate(script, cwd)
    if source is not None and uses_worker_library(source, cwd):
        return
    globs = " ".join(repr(g) for g in config.checkpoints.globs)
    who = Path(script.name).name if script else "the command"
    why = (f"no {{checkpoint}} or {{checkpoint_step}} in the command, no --resume-args or --edit, and {who} "
           + ("does not use oomguard's worker library" if source is not None else "could not be read to see "
              "whether it uses oomguard's worker library"))
    raise UsageError("--checkpoint", f"{globs} is watched, but nothing hands the checkpoint to the script, so "
                     f"every restart would start over at step 1 ({why})",
                     "add your script's resume flag, e.g. --resume-args '--resume {checkpoint}', or "
                     "--resumes-itself if the script finds its checkpoint by itself")


def locate(script: Script | None, cwd: Path) -> Path | None:
    """The source file of the script, where it can be found without running anything."""
    if script is None:
        return None
    if script.kind == "module":
        return _module_file(script.name, [str(cwd), *sys.path[1:]])
    if script.kind == "program" and os.sep not in script.name:  # torchrun --no-python PROGRAM on PATH
        found = shutil.which(script.name)
        return Path(found) if found else None
    path = cwd / script.name
    return path if path.is_file() else None


def _module_file(name: str, search: list[str]) -> Path | None:
    """``pkg.mod``'s file, found package by package with ``PathFinder`` (which imports nothing)."""
    path: list[str] | None = search
    spec = None
    parts = name.split(".")
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    if spec.submodule_search_locations:  # python -m pkg runs pkg/__main__.py
        main = Path(spec.origin).parent / "__main__.py"
        return main if main.is_file() else None
    return Path(spec.origin)


def uses_worker_library(source: Path, cwd: Path, names: frozenset[str] = LIBRARY_ENV) -> bool:
    """Does the script, or one of the user's own modules it imports (under its directory or ``cwd``),
    import oomguard or read one of ``names``?"""
    roots = {source.parent.resolve(), cwd.resolve()}
    queue, seen = [source.resolve()], set[Path]()
    while queue and len(seen) < _MAX_SOURCES:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        found, imported = _scan(path, names)
        if found:
            return True
        queue += [p for p in (_local(name, path, roots) for name in imported) if p is not None]
    return False


def _scan(path: Path, env: frozenset[str]) -> tuple[bool, list[str]]:
    """(uses the library or one of the variables ``env``, the modules or files it names) for one source file."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_SOURCE_BYTES)
    except OSError:
        return False, []
    if b"\0" in data:  # a compiled program: only the variables' names can be seen in it
        return any(name.encode() in data for name in env), []
    text = data.decode(errors="replace")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # a shell script: the variables, and the .py files it runs
        uses = any(re.search(rf"\b{name}\b", text) for name in env)
        return uses, re.findall(r"[\w./-]+\.py\b", text)
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base, *(f"{base}.{alias.name}" if node.module else base + alias.name for alias in node.names)]
        elif isinstance(node, ast.Constant) and node.value in env:
            return True, []
    if any(n == "oomguard" or n.startswith("oomguard.") for n in names):
        return True, []
    return False, names


def _local(name: str, importer: Path, roots: set[Path]) -> Path | None:
    """The file of an imported module, if it is the user's own (under the script's directory or cwd)."""
    if name.endswith(".py"):  # a file a shell script runs
        candidates = [root / name for root in roots]
    else:
        level = len(name) - len(name.lstrip("."))
        parts = name.lstrip(".").split(".") if name.lstrip(".") else []
        bases = [importer.parent.joinpath(*[".."] * (level - 1))] if level else list(roots)
        candidates = [base.joinpath(*parts).with_suffix(".py") for base in bases if parts]
        candidates += [base.joinpath(*parts, "__init__.py") for base in bases if parts]
    for path in candidates:
        try:
            resolved = path.resolve()
        except OSError:
            continue
        if resolved.is_file() and any(resolved.is_relative_to(root) for root in roots):
            return resolved
    return None


def resume_hint(config: RunConfig) -> str:
    """What to check when an attempt did not resume from its checkpoint, for this run's hand-over."""
    if config.checkpoints.resume_args:
        return "check --resume-args"
    if used(config.command) & CHECKPOINT_NAMES:
        return "check where the command passes {checkpoint}"
    if used(config.edit_values) & CHECKPOINT_NAMES:
        return "check --edit"
    if config.checkpoints.resumes_itself:
        return "--resumes-itself says the script finds its checkpoint by itself, but it did not load it"
    return "check that the script resumes (the worker library's Session loads OOMGUARD_CHECKPOINT)"


# Whether oomguard can steer the command at all: checked at start.
#
# oomguard recovers from an OOM by running the command again with a smaller micro-batch. A command
# given no batch (``python train.py --batch-size 64``, or a batch in a settings file no ``--edit``
# names) runs the same batch whatever the plan says: status showed ``64 × 2 = 128`` while the script
# trained at 64 × 1, and each OOM "halved" a number nothing read, down to 1 and "the model does not
# fit". So a command is refused, one line and exit 2, when nothing in it can carry the plan:
#
# - no batch placeholder (``{micro_batch}``, ``{grad_accum}``, ``{grad_accum_total}``,
#   ``{global_batch}``) in the command, ``--resume-args``, ``--fallback-args`` or an ``--edit``;
# - no ``OOMGUARD_`` variable named in the command itself (``sh -c '... $OOMGUARD_MICRO_BATCH'``,
#   ``python -c CODE``);
# - and the script, read as ``run/preflight.py`` reads it (never run), neither imports the worker
#   library nor reads one of the variables oomguard sets for each attempt.
#
# A script that cannot be read at all (a module not installed here, a program that is not found) is
# not refused on a guess.


BATCH_PLACEHOLDERS = frozenset({"micro_batch", "grad_accum", "grad_accum_total", "global_batch"})
# Every variable an attempt is started with: a script that reads one of them talks to oomguard.
PLAN_ENV = frozenset(value for name, value in vars(protocol).items() if name.startswith("ENV_"))
FIX = ("put {micro_batch} where the script takes its batch (e.g. --batch-size {micro_batch}), name the settings "
       "file that holds it with --edit FILE:KEY={micro_batch}, or read the plan with oomguard's worker library "
       "(from oomguard import Session)")


def check_steering(config: RunConfig, cwd: Path) -> None:
    """UsageError when a halving would change nothing the command runs."""
    texts = [*config.templates, *config.edit_values]
    if used(texts) & BATCH_PLACEHOLDERS or any("OOMGUARD_" in text for text in texts):
        return
    found = _source(config.command, cwd)
    if found is None:  # nothing could be read: not refused on a guess
        return
    source, who = found
    if source is not None and uses_worker_library(source, cwd, PLAN_ENV):
        return
    raise UsageError("COMMAND", f"oomguard cannot steer this command: it passes no {{micro_batch}} or {{grad_accum}}, "
                     f"no --edit names a settings file, and {who} neither uses oomguard's worker library nor reads "
                     "an OOMGUARD_ variable, so a smaller micro-batch would change nothing it runs", FIX)


def _source(command: Sequence[str], cwd: Path) -> tuple[Path | None, str] | None:
    """(the file to read or None for inline code, its name for the message); None when nothing can be read."""
    script = script_of(command)
    if script is not None:
        path = locate(script, cwd)
        return (path, Path(script.name).name) if path is not None else None
    if len(command) > 1 and is_interpreter(command[0]) and "-c" in command[1:]:
        return None, "its inline code"
    found = shutil.which(command[0]) if command else None
    if found is None or is_interpreter(command[0]):
        return None
    return Path(found), command[0]


SAMPLE_CHECKPOINT = "/tmp/a run's dir/ckpt step-100.pt"  # a space and a quote: quoting must survive it


def check(config: RunConfig, cwd: Path | None = None) -> list[str]:
    """The argv of a restart from a checkpoint with every fallback; UsageError if it cannot be run."""
    _check_splits(config)
    plan = Plan(config.initial_plan, True, len(config.batch.fallback_args))
    sample = Checkpoint(SAMPLE_CHECKPOINT, 100, 0.0, 1)
    values = placeholder_values(config, plan, 2, sample)
    try:
        argv = build_argv(config, plan, values)
        env = build_env(config, plan, values, AttemptFiles.of(config.run_dir, 2))
    except (ValueError, KeyError, IndexError) as exc:
        raise UsageError("COMMAND", f"cannot be rendered for a restart ({exc})",
                         "check the placeholders in the command, --resume-args and --fallback-args") from None
    cwd = cwd or Path.cwd()
    _check_executable(argv[0], env, cwd)
    script = script_of(config.command)
    check_files(script, cwd)  # the script exists,
    check_resume(config, script, cwd)  # and something hands it its checkpoint
    check_steering(config, cwd)  # and something hands it the batch
    return argv


def notices(config: RunConfig, cwd: Path | None = None) -> list[str]:
    """One line each, said at start, for what runs differently from how it reads."""
    lines = []
    launch = launcher.parse(config.command)
    if isinstance(launch, AccelerateLaunch) and launch.note:
        lines.append(launch.note)
    batch = config.initial_plan
    if config.accumulation is Carrier.NONE:
        lines.append(no_accumulation_line(batch.micro_batch, batch.world_size, config.batch.allow_smaller_global_batch))
    warning = total_warning(config.command, launcher.program(config.command), cwd or Path.cwd(), batch.grad_accum,
                            batch.world_size, batch.micro_batch)
    if warning is not None:
        lines.append(warning)
    return lines


def _check_splits(config: RunConfig) -> None:
    """``--resume-args`` and each ``--fallback-args`` are split like a shell would split them."""
    texts = [("--resume-args", config.checkpoints.resume_args),
             *(("--fallback-args", f) for f in config.batch.fallback_args)]
    for option, text in texts:
        try:
            shlex.split(text)
        except ValueError as exc:
            raise UsageError(option, f"{text!r} cannot be split into arguments ({exc})",
                             "balance the quotes, e.g. --resume-args \"--resume '{checkpoint}'\"") from None


def _check_executable(program: str, env: dict[str, str], cwd: Path) -> None:
    """The launcher would fail with exit 127 after three attempts; say so now."""
    if not program:
        raise UsageError("COMMAND", "the command is empty", "put the training command after --")
    if os.sep in program:
        path = cwd / program
        if not os.path.exists(path):
            raise UsageError("COMMAND", f"{program} does not exist", "check the path of the training command")
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            raise UsageError("COMMAND", f"{program} is not an executable file",
                             f"chmod +x {program}, or run it through its interpreter (python {program})")
        return
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise UsageError("COMMAND", f"{program!r} is not found on PATH", "install it or give its full path")


# Reading ``oomguard run``'s arguments outside ``oomguard run``, and saying what a mistyped line meant.
#
# ``oomguard service`` writes a unit that runs ``oomguard run ARGS`` later, under systemd, where a typo
# in ARGS would only show when the unit starts. ``check_run_args`` reads ARGS as ``oomguard run`` does
# (the options generated from ``RunConfig``, its validation, the start checks of ``preflight``), so a
# unit is written only for a command that would start.
#
# An argument argparse does not know is often the training command with its ``--`` forgotten
# (``oomguard run --micro-batch 8 python train.py``): ``unrecognized`` says to put ``--`` before it, and
# names the option a mistyped one was probably meant to be (``--micro-bach`` -> ``--micro-batch``).

_LAUNCHERS = re.compile(r"^(python[0-9.]*|pypy[0-9.]*|torchrun|accelerate|deepspeed|uv|bash|sh)$")


def looks_like_command(word: str) -> bool:
    """``python``, ``torchrun``, ``./train.sh``, ``train.py`` or any program on PATH."""
    if not word or word.startswith("-"):
        return False
    return bool(_LAUNCHERS.match(Path(word).name)) or os.sep in word or word.endswith((".py", ".sh")) \
        or shutil.which(word) is not None


def unrecognized(extras: Sequence[str], flags: Iterable[str], subcommand: str | None,
                 typed: Sequence[str] = ()) -> str:
    """The one-line message for arguments argparse did not take; ``typed``, every word given the
    subcommand, so the suggested line keeps the script's flags argparse took as oomguard's."""
    text = f"unrecognized arguments: {' '.join(extras)}"
    first = extras[0]
    if subcommand in ("run", "service") and looks_like_command(first):
        start = _position(typed, extras)
        form = _form(subcommand, None, extras) if start is None else _form(subcommand, typed[:start], typed[start:])
        return f"{text}; put -- before the training command: {form}"
    if first.startswith("-"):
        close = difflib.get_close_matches(first.partition("=")[0], sorted(flags), n=1, cutoff=0.6)
        if close:
            return f"{text} (did you mean {close[0]}?)"
    return text


def ambiguous(message: str, typed: Sequence[str], parser: argparse.ArgumentParser, subcommand: str) -> str:
    """An ambiguous option is most often the script's own with the ``--`` forgotten: say so."""
    if not message.startswith("ambiguous option") or subcommand not in ("run", "service"):
        return message
    start = _command_start(typed, parser)
    if start is None:
        return message
    option = message.split(":", 1)[1].split()[0]
    return (f"{message}; if {option} is the training script's, put -- before the training command: "
            f"{_form(subcommand, typed[:start], typed[start:])}")


def _form(subcommand: str, options: Sequence[str] | None, command: Sequence[str]) -> str:
    """The command line as it was meant, every word kept and quoted as a shell needs."""
    run = "[options]" if options is None else shlex.join(options)
    head = f"oomguard service [options] -- {run}" if subcommand == "service" else f"oomguard run {run}"
    return f"{' '.join(head.split())} -- {shlex.join(command)}"


def _position(typed: Sequence[str], extras: Sequence[str]) -> int | None:
    """Where in ``typed`` the words argparse did not take follow in order: the training command."""
    for start in (i for i, word in enumerate(typed) if word == extras[0]):
        rest = iter(typed[start:])
        if all(any(word == extra for word in rest) for extra in extras):
            return start
    return None


def _command_start(typed: Sequence[str], parser: argparse.ArgumentParser) -> int | None:
    """The first word that looks like a command and is no option's value."""
    skip = False
    for i, word in enumerate(typed):
        if skip:
            skip = False
            continue
        if word.startswith("-"):
            action = parser._option_string_actions.get(word.partition("=")[0])
            skip = action is not None and action.nargs != 0 and "=" not in word
            continue
        if looks_like_command(word):
            return i
    return None


class OptionParser(argparse.ArgumentParser):
    """The one parser of oomguard's command lines (the CLI's, and ``oomguard service``'s reading of ``run``'s):
    fragment options joined, a usage error raised as one UsageError line (the CLI exits 2)."""

    typed: Sequence[str] = ()  # the words this parser was given: a suggestion keeps every one
    command: str | None = None  # where it reads one command's options alone: whose line a suggestion repeats

    def error(self, message: str) -> NoReturn:
        message = ambiguous(message, self.typed, self, self.command or self.prog.rpartition(" ")[2])
        raise UsageError("", message, f"see '{self.prog} --help'")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """Fragment options' values joined (``--resume-args=--init_from=resume``): ``config.join_fragments``."""
        flags = fragment_flags() & self._option_string_actions.keys()
        argv = list(sys.argv[1:] if args is None else args)
        self.typed = argv
        return super().parse_known_args(join_fragments(argv, frozenset(flags)) if flags else argv, namespace)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """An unknown argument that looks like the training command says to put -- before it."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            sub, typed = getattr(parsed, "subcommand", None), list(self.typed)
            if sub is None:
                sub = self.command
            else:
                typed = typed[typed.index(sub) + 1:] if sub in typed else []
            self.error(unrecognized(extras, _flags(self, sub), sub, typed))
        return parsed


def _flags(parser: argparse.ArgumentParser, subcommand: str | None) -> list[str]:
    """The option strings of ``subcommand`` (else of ``parser``), for a "did you mean"."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and subcommand in action.choices:
            return list(action.choices[subcommand]._option_string_actions)
    return list(parser._option_string_actions)


def split_command(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """The words before the first ``--``, and the training command after it."""
    at = words.index("--") if "--" in words else len(words)
    return list(words[:at]), list(words[at + 1:])


def check_run_args(args: Sequence[str], cwd: Path, subcommand: str = "service") -> RunConfig:
    """The RunConfig ``oomguard run ARGS`` would run in ``cwd``, with its start checks; else UsageError."""
    options, command = split_command(args)
    parser = OptionParser(prog="oomguard run", add_help=False)
    parser.command = subcommand
    add_arguments(parser)
    try:
        namespace = parser.parse_args(options)
    except UsageError as error:
        raise UsageError("", f"in the oomguard run arguments: {error}") from None
    config = build_config(vars(namespace), command)
    check(config, cwd)
    check_edits(config.batch.edits, config.command, cwd)
    return config
