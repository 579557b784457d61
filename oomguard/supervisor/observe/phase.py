"""Which phase of training an attempt was in when it failed: evaluation, saving or loading a checkpoint.

Read from what the output scanner kept: the function names of the newest traceback (innermost
first, so ``train -> evaluate -> forward`` is evaluation, and ``evaluate -> torch.save`` is saving), or,
when the worker died without one (SIGKILL from the OOM killer), its last lines of output such as
``Evaluating...`` or ``Saving checkpoint to ...``. Pure: the tests feed it lines.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence


class Phase(enum.Enum):
    EVALUATION = "evaluation"
    SAVING = "checkpoint saving"
    LOADING = "checkpoint loading"


# Function names, matched on their ``_``-separated words: ``evaluate``, ``eval_loop``,
# ``evaluation_loop``, ``validation_step``, ``_validate``; ``save``, ``torch.save``'s ``save``,
# ``save_checkpoint``, ``save_pretrained``, ``_save``; ``load``, ``load_state_dict``,
# ``_load_from_state_dict``, ``load_checkpoint``, ``from_pretrained``. ``dataloader`` or
# ``_next_data`` are none of them.
_FUNCTION = {
    Phase.EVALUATION: re.compile(r"(?:^|_)(?:eval|evaluate|evaluation|evaluator|validate|validation|val)(?:_|$)"),
    Phase.SAVING: re.compile(r"(?:^|_)(?:save|saving|checkpointing)(?:_|$)|^_?write_checkpoint"),
    Phase.LOADING: re.compile(r"(?:^|_)(?:load|loading|restore|resume)(?:_|$)|^from_pretrained$"),
}
# Lines a script prints as it enters a phase (only the last few lines are read).
_LINE = {
    Phase.EVALUATION: re.compile(r"^\W*(?:running |starting )?(?:evaluat|validat)\w*", re.IGNORECASE),
    Phase.SAVING: re.compile(r"\bsaving (?:the )?(?:model|checkpoint|state)", re.IGNORECASE),
    Phase.LOADING: re.compile(r"\b(?:loading|resuming from) (?:the )?(?:model|checkpoint|state)", re.IGNORECASE),
}
LAST_LINES = 3


def phase_of(frames: Sequence[str], tail: Sequence[str]) -> tuple[Phase, str] | None:
    """(phase, the evidence that named it), or None when nothing names a phase."""
    for name in reversed(frames):  # innermost first: the phase the failing call was made in
        for phase, pattern in _FUNCTION.items():
            if pattern.search(name):
                return phase, f"traceback through {name}()"
    if frames:
        return None  # a traceback that names no phase: training itself
    last = [line.strip() for line in tail if line.strip()][-LAST_LINES:]
    for line in reversed(last):
        for phase, pattern in _LINE.items():
            if pattern.search(line):
                return phase, f"last output: {line[:120]}"
    return None
