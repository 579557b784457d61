"""The step a checkpoint holds, from the best evidence there is, and which evidence that was.

In order: (1) the probe's ``save`` record of the file, or of a file inside the checkpoint's
directory, either under the temp name an atomic writer renamed into place
(``AttemptWatch.saved_step``): the optimizer's own count when the save began, measured in the
worker; (2) the checkpoint's own record where reading it is cheap and safe (HF's
``trainer_state.json``, whose ``global_step`` its ``checkpoint-N`` name repeats); (3) its name,
only a number labelled as a step or the name's sole number (``observe/ckptname.py``); (4) the step
the worker reported when the file was written (``AttemptWatch.step_at``); else unknown, and said
so, never guessed.

A measured step beats a name that says another: every other step oomguard reports (progress, the
resume check, the journal, ``{checkpoint_step}`` for a worker whose optimizer keeps no count) is
the optimizer's count, and names count other things under the same label: accelerate's examples
name ``step_{overall_step}``, a count of micro-batches that is ``grad_accum`` times the optimizer's
under gradient accumulation (which oomguard raises as it halves the micro-batch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

SAVE = "save"  # the probe's save record
OWN_RECORD = "trainer_state"  # HF's trainer_state.json in the checkpoint directory
NAME = "name"
OUTPUT = "output"  # the step reported when the file was written
JOURNAL = "journal"  # the step the journal kept for it, resolved by an earlier supervisor on the run
_STATE_MAX_BYTES = 16 * 2**20  # its log history grows with the run; a larger file is not read


@dataclass(frozen=True)
class StepEvidence:
    step: int | None
    source: str | None  # one of the sources above; None when the step is unknown


def resolve(saved: int | None, own: StepEvidence, by_time: int | None) -> StepEvidence:
    """The best of the evidence: the probe's save record, the checkpoint's own (its record or its
    name, as the index found it), the step reported at its mtime; unknown when none says one."""
    if saved is not None:
        return StepEvidence(saved, SAVE)
    if own.step is not None:
        return own
    if by_time is not None:
        return StepEvidence(by_time, OUTPUT)
    return StepEvidence(None, None)


def recorded_step(path: str) -> int | None:
    """``global_step`` from ``<path>/trainer_state.json`` (HF Trainer writes it into each
    ``checkpoint-N``), or None where there is none, it is too large, or it does not parse."""
    state = os.path.join(path, "trainer_state.json")
    try:
        st = os.stat(state)
    except OSError:
        return None
    if st.st_size > _STATE_MAX_BYTES:
        return None
    return _global_step(state, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=256)
def _global_step(state: str, mtime_ns: int, size: int) -> int | None:
    """Read once per version of the file (the index rescans on every change in the directory)."""
    try:
        with open(state, encoding="utf-8") as f:
            step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
