"""``{micro_batch}``-style placeholders in the user's command and ``--resume-args``."""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping

from oomguard.supervisor.errors import UsageError

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
