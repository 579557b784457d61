"""Training progress read from the worker's output, for scripts that do not use the worker library.

``StepMatcher`` maps one line of output to the step it reports (and the total, when the line shows
one), or None. Built-in patterns cover what the common trainers print by default; ``--progress-pattern``
adds the user's own (a regular expression with a named group ``step`` and optionally ``total``),
tried first. Pure: the output thread feeds it lines, the loop reads what ``observe.progress`` kept.

Progress only from progress: a number in a path or a file name is the step of a file
(``ckpts/epoch=0-step=4.ckpt``, ``out/checkpoint-500``), and a line about saving, loading, restoring
or resuming a checkpoint names the step it was written at, not the step training is at. Both are
taken out before any pattern looks at the line. A progress bar is read before that rule, so a log
line glued to a bar's redraw (``2/6 [00:03<00:07][transformers] Saving model checkpoint to ...``)
still gives the bar's step. ``tests/progress_corpus/`` holds real lines captured from Lightning, the
Hugging Face Trainer, Accelerate, nanoGPT and nanochat, each with the step it shows, and the tests
check every one of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Terminal control sequences: colours and cursor moves of a bar drawn for a terminal (Rich when it
# renders, tqdm's nested bars' cursor-up).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# Lightning's bars that are not training: their numbers are batches of another loop.
_OTHER_LOOP = re.compile(r"^\s*(?:Sanity Checking|Validation|Testing|Predicting)\b")
# A token that is a path (a slash next to a letter: ``out/checkpoint-2``, not ``45/100``), a file
# name with a known extension, or a name formatted from metrics (Lightning's ``epoch=0-step=4``).
_PATHLIKE = re.compile(
    r"""[^\s'"`\[\](){}]*(?:[A-Za-z_.~][/\\]|[/\\][A-Za-z_.~])[^\s'"`\[\](){}]*"""
    r"""|[^\s'"`\[\](){}]+\.(?:ckpt|pt|pth|bin|safetensors|pkl|pickle|json|ya?ml|npz|npy|h5|hdf5|msgpack|tar|zip"""
    r"""|gz|distcp|model|parquet)\b[^\s'"`]*"""
    r"""|[^\s'"`\[\](){}]*\w=\d+[-_]\w+=\d+[^\s'"`\[\](){}]*"""
)
# A line about a checkpoint being saved, loaded, restored or resumed from, or batches being skipped.
_CHECKPOINT_MESSAGE = re.compile(
    r"\b(?:restor\w*|resum\w*|continu\w* training|sav(?:e|es|ed|ing)|load(?:s|ed|ing)?|skip(?:s|ped|ping)?"
    r"|checkpoint\w*|ckpt)\b", re.IGNORECASE)
# A bar's own description, when it has one, must say it is training: "Map", "Writing model shards"
# and "Loading checkpoint shards" count other things.
_TRAINING_DESCRIPTION = re.compile(r"^\s*$|\b(?:epoch|train|step|iter|batch|update|optim)", re.IGNORECASE)

# Bars, read before the checkpoint-message rule. Each has the named group ``step`` and maybe ``total``
# and ``epoch``; ``per_epoch`` marks a bar that counts batches within an epoch (Lightning's).
_BARS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Lightning's Rich bar: "Epoch 2/4  ━━━━━━━━━━╸━━━━━━━━━ 5/8 0:00:04 • 0:00:03 1.69it/s v_num: 0"
    ("lightning rich",
     re.compile(r"^\s*Epoch (?P<epoch>\d+)/(?P<epochs>-?\d+)\s+[^\d\s]*\s*(?P<step>\d+)/(?P<total>\d+)\s")),
    # Lightning's TQDM bar: "Epoch 2:  45%|████▌     | 45/100 [00:03<00:04, 13.52it/s, v_num=0]"
    ("lightning tqdm", re.compile(r"^\s*Epoch (?P<epoch>\d+):.*?\|\s*(?P<step>\d+)/(?P<total>\d+) \[")),
    # tqdm (Hugging Face Trainer, Accelerate scripts): " 40%|████      | 40/100 [00:12<00:18,  3.30it/s]",
    # with or without the percentage block: "12/100 [00:01<00:09"
    ("tqdm", re.compile(r"^(?P<desc>[^|\[]*?)(?::\s*)?(?:\d+%\|[^|]*\|\s*|(?<!\S))(?P<step>\d+)/(?P<total>\d+) \[\d")),
)
# Text lines, read after it. nanoGPT: "iter 120: loss 3.2100, time 41.23ms" and "step 250: train loss 2.9";
# nanochat: "step 00120/01000 (12.00%) | loss: 3.21"; "Step: 120 / 1000"; "global_step=120"; "step 120".
_TEXT: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("nanogpt", re.compile(r"^\s*(?:iter|step) (?P<step>\d+): ")),
    ("step N/M", re.compile(r"\b(?:global_)?step[\s:=]+(?P<step>\d+)\s*/\s*(?P<total>\d+)\b", re.IGNORECASE)),
    ("step N", re.compile(r"\b(?:global[_ ])?step[\s:=]+(?P<step>\d+)\b", re.IGNORECASE)),
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
    """Line -> StepSeen or None. A custom pattern is tried before the built-ins.

    ``batches_per_step`` is the gradient accumulation the worker was given: Lightning's bars count
    batches, its checkpoints (``step=S``) and everyone else count optimizer steps.
    """

    def __init__(self, custom: str | None = None, batches_per_step: int = 1) -> None:
        self.custom = compile_pattern(custom) if custom else None
        self.batches_per_step = max(1, batches_per_step)

    def match(self, line: str) -> StepSeen | None:
        if len(line) > 2000 or not any(c.isdigit() for c in line):  # cheap exits for the common line
            return None
        if "\x1b" in line:
            line = _ANSI.sub("", line)
        if self.custom is not None and (seen := _read(self.custom.search(line))) is not None:
            return seen
        if _OTHER_LOOP.match(line):
            return None
        line = _PATHLIKE.sub(" ", line) if ("/" in line or "." in line or "=" in line or "\\" in line) else line
        for _, pattern in _BARS:
            if (m := pattern.search(line)) is not None and (seen := self._bar(m)) is not None:
                return seen
        if _CHECKPOINT_MESSAGE.search(line):
            return None
        for _, pattern in _TEXT:
            if (seen := _read(pattern.search(line))) is not None:
                return seen
        return None

    def _bar(self, m: re.Match[str]) -> StepSeen | None:
        groups = m.groupdict()
        if groups.get("desc") is not None and not _TRAINING_DESCRIPTION.search(groups["desc"]):
            return None
        step, total = int(m.group("step")), int(m.group("total"))
        if groups.get("epoch") is None:
            return StepSeen(step, total)
        # Lightning counts batches within the epoch: epoch × batches per epoch + batch, in optimizer
        # steps. The Rich bar also shows the last epoch ("Epoch 2/4"), hence the run's total.
        per = self.batches_per_step
        epochs = int(groups["epochs"]) + 1 if groups.get("epochs") and int(groups["epochs"]) >= 0 else None
        return StepSeen((int(groups["epoch"]) * total + step) // per, epochs * total // per if epochs else None)


def _read(m: re.Match[str] | None) -> StepSeen | None:
    if m is None:
        return None
    try:
        total = m.groupdict().get("total")
        return StepSeen(int(m.group("step")), int(total) if total else None)
    except (TypeError, ValueError, IndexError):  # a custom pattern whose group matched no number
        return None
