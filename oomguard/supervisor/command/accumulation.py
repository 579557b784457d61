"""How the training command hands the script its gradient accumulation, read once at start.

oomguard keeps ``global = micro × accumulation × world`` only where the script is told the
accumulation. ``carrier`` says how it is told:

- a placeholder: ``{grad_accum}`` (per rank) or ``{grad_accum_total}`` (summed over the ranks, for
  scripts that divide by the world size as nanoGPT does), in the command, ``--resume-args``,
  ``--fallback-args`` or an ``--edit``;
- the environment: the command reads ``$OOMGUARD_GRAD_ACCUM`` (or ``$OOMGUARD_GLOBAL_BATCH``);
- derived by the script from a total it is given: ``{global_batch}``, or nanochat's
  ``--total_batch_size`` (the script computes its own accumulation from it);
- none: the command passes ``{micro_batch}`` and nothing else. Then a smaller micro-batch is a
  smaller global batch, and oomguard says so at start instead of claiming the global batch is kept;
- unseen: no ``{micro_batch}`` either: the script reads the whole plan from the environment (the
  worker library).

``total_warning`` is the other way to get it wrong: a script that divides the accumulation it is
given by the world size (nanoGPT's ``gradient_accumulation_steps //= ddp_world_size``) handed the
per-rank ``{grad_accum}`` trains at a global batch ``world`` times too small.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from pathlib import Path

from oomguard.supervisor.command.placeholders import used

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
    """How ``texts`` (the command's words, --resume-args, --fallback-args, the --edit values) hand
    the script its accumulation."""
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
    path = Path(words[0]) if Path(words[0]).is_absolute() else cwd / words[0]
    return path if path.is_file() else None


def _divided_names(script: Path) -> set[str]:
    """The variables the script divides by the world size, by their last name (``args.x`` -> x)."""
    try:
        with open(script, encoding="utf-8", errors="replace") as fh:
            source = fh.read(_SOURCE_LIMIT)
    except OSError:
        return set()
    return {match["name"].rpartition(".")[2].lower() for match in _DIVIDES.finditer(source)}

