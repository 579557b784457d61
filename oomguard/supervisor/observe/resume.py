"""Did the attempt start where it was told to? Its first step against the checkpoint's step.

An attempt started from a checkpoint at step N must show (in its output, or in the worker
library's progress records) a first step past N. A script that was not really handed the
checkpoint (a resume flag it ignores, a fixed path it does not read) starts over at step 1 and
every failure quietly redoes everything; ``ResumeCheck`` turns its first step into a verdict the
loop says at once, and the report counts the steps that were really redone.

Which first step counts:

- step 0 does not: a progress bar prints ``0/100`` when it is drawn, before a resumed Trainer
  jumps it to N+1; a script that did start over shows step 1 next;
- a bar whose total is at most N does not: the training that reached step N runs to more than N,
  so a shorter bar is another one (``Loading checkpoint shards 1/2``, an evaluation's 5/50);
- a first step of N - 1 or more is a resume. Scripts number steps differently: a checkpoint
  ``step-N`` may be followed by step N+1 (saved after step N, counted from 1), by step N itself
  (nanoGPT saves before running iteration N, whose step a resumed run prints again), or by N - 1
  (a step read off the output a beat late, or counted from 0). ``MARGIN`` = 2 covers those; a first
  step at N - 2 or below means at least two steps redone that no numbering explains. (With N of 1
  or 2, a start over cannot be told from a numbering and is not said.)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

MARGIN = 2


@dataclass(frozen=True)
class ResumeVerdict:
    path: str  # the checkpoint the attempt was started from
    step: int  # its step
    first_step: int  # the first step the attempt showed

    @property
    def resumed(self) -> bool:
        return self.first_step > self.step - MARGIN

    def message(self, hint: str) -> str:
        """One line for the console, the journal, status and the notification."""
        name = Path(self.path).name
        if self.first_step <= 1:
            return f"the script started over at step {self.first_step}, not from {name}: {hint}"
        return (f"the script went back to step {self.first_step}, not on from {name} (step {self.step}): "
                f"{self.step - self.first_step + 1} step(s) redone; {hint}")


class ResumeCheck:
    """Fed every step an attempt shows (the output thread and the loop both feed it); the verdict
    is taken from the first one that counts."""

    def __init__(self, path: str, step: int) -> None:
        self.path = path
        self.step = step
        self._first: int | None = None
        self._lock = threading.Lock()

    def see(self, step: int, total: int | None = None) -> None:
        if step < 1 or (total is not None and total <= self.step):
            return
        with self._lock:
            if self._first is None:
                self._first = step

    @property
    def verdict(self) -> ResumeVerdict | None:
        with self._lock:
            first = self._first
        return None if first is None else ResumeVerdict(self.path, self.step, first)
