"""Training progress read from the worker's output, for scripts that do not use the worker library.

``StepMatcher`` maps one line of output to the step it reports (and the total, when the line shows
one), or None. Built-in patterns cover what the common trainers print; ``--progress-pattern`` adds
the user's own (a regular expression with a named group ``step`` and optionally ``total``), tried
first. Pure: the output thread feeds it lines, the loop reads what ``observe.progress`` kept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Built-in patterns, most specific first. Each has the named group ``step`` and maybe ``total``.
BUILTIN: tuple[tuple[str, re.Pattern[str]], ...] = (
    # nanoGPT: "iter 120: loss 3.2100, time 41.23ms, mfu 12.34%" and "step 250: train loss 2.9, val loss 3.0"
    ("nanogpt", re.compile(r"^\s*(?:iter|step) (?P<step>\d+): ")),
    # Lightning's bar counts batches within the epoch: "Epoch 2:  45%|███▌ | 45/100 [00:03<00:04, ...]"
    # is step 2 * 100 + 45 (the number of epochs, hence the total, is not shown).
    ("lightning", re.compile(r"Epoch (?P<epoch>\d+):.*?\|\s*(?P<step>\d+)/(?P<total>\d+) \[")),
    # Hugging Face Trainer logs dicts with the epoch, not the step; its tqdm bar carries the step:
    # " 40%|████      | 40/100 [00:12<00:18,  3.30it/s]".
    ("progress bar", re.compile(r"\|\s*(?P<step>\d+)/(?P<total>\d+) \[")),
    # "step 120/1000", "Step: 120 / 1000", "global_step=120", "step 120" (nanochat: "step 00120/01000 (12.00%)")
    ("step N/M", re.compile(r"\b(?:global_)?step[\s:=]+(?P<step>\d+)\s*/\s*(?P<total>\d+)\b", re.IGNORECASE)),
    ("step N", re.compile(r"\b(?:global_)?step[\s:=]+(?P<step>\d+)\b", re.IGNORECASE)),
    # a bare tqdm bar without a percentage block: "12/100 [00:01<00:09"
    ("tqdm", re.compile(r"(?:^|\s)(?P<step>\d+)/(?P<total>\d+) \[\d")),
)


@dataclass(frozen=True)
class StepSeen:
    step: int
    total: int | None


def compile_pattern(text: str) -> re.Pattern[str]:
    """The user's ``--progress-pattern``; ValueError (naming the fix) when it cannot be used."""
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise ValueError(f"{text!r} is not a regular expression ({exc})") from None
    if "step" not in pattern.groupindex:
        raise ValueError(f"{text!r} has no named group 'step'; write e.g. 'it=(?P<step>\\d+)'")
    return pattern


class StepMatcher:
    """Line -> StepSeen or None. A custom pattern is tried before the built-ins."""

    def __init__(self, custom: str | None = None) -> None:
        self.patterns = ([compile_pattern(custom)] if custom else []) + [p for _, p in BUILTIN]

    def match(self, line: str) -> StepSeen | None:
        if len(line) > 2000 or not any(c.isdigit() for c in line):  # cheap exits for the common line
            return None
        for pattern in self.patterns:
            m = pattern.search(line)
            if m is None:
                continue
            try:
                step = int(m.group("step"))
                total = m.groupdict().get("total")
                epoch = m.groupdict().get("epoch")
                if epoch is not None and total:  # per-epoch batches -> a global step
                    return StepSeen(int(epoch) * int(total) + step, None)
                return StepSeen(step, int(total) if total else None)
            except (TypeError, ValueError):  # a custom pattern whose group matched no number
                continue
        return None
