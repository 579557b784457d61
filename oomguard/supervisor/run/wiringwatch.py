"""While the run goes: did each attempt resume where it was told to, and do the ``--checkpoint``
globs match what the script writes?

The start checks (``run/preflight.py``) catch a checkpoint nothing hands over; these two can only be
seen while the script runs. Each is said at once and once: on the console, in the journal (the
events below), in ``oomguard status`` and the dashboard (the meta's ``warnings``) and by the
webhooks (``ops/hooks.py`` forwards the events, once per kind).

- ``not_resumed`` (path, step, first_step, message): an attempt started from a checkpoint showed a
  first step that is no resume (``observe/checkpoints.py``); the report counts the steps really redone
  from it;
- ``checkpoint_glob_unmatched`` (globs, files, suggestion, message): the worker wrote a file that
  looks like a checkpoint and no glob matches, said within a second of its appearing (and of the
  evidence that the worker wrote it: the probe's ``save`` record, or its process holding the file
  open for writing), during the attempt that wrote it; or the globs match nothing while the script
  trains and writes nothing like a checkpoint at all (``observe/checkpoints.py``). A file another
  process writes under the working directory is never named.

Tested in tests/e2e/test_wiring.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.observe.checkpoints import (
    Checkpoint,
    CheckpointIndex,
    LookalikeWatcher,
    ResumeCheck,
    missed,
    missed_notice,
    output_dirs,
    suggest_glob,
    unmatched_notice,
)
from oomguard.supervisor.observe.progress import AttemptWatch
from oomguard.supervisor.run.preflight import resume_hint

NOT_RESUMED = "not_resumed"
GLOB_UNMATCHED = "checkpoint_glob_unmatched"
WARNING_EVENTS = (NOT_RESUMED, GLOB_UNMATCHED)
MAX_WARNINGS = 20  # kept for status; the journal keeps every event
GLOB_EVERY = 1.0  # seconds between looks at the globs and the look-alikes


class WiringWatch:
    def __init__(self, config: RunConfig, cwd: Path, run_dir: Path, say: Callable[[str], None],
                 event: Callable[..., None], set_meta: Callable[..., None],
                 pids: Callable[[], Sequence[int]] = tuple) -> None:
        self.config = config
        self.pids = pids  # the worker's processes, as last sampled: whose open files are its writes
        self.cwd = cwd
        self.run_dir = run_dir
        self._say, self._event, self._set_meta = say, event, set_meta
        self.warnings: list[dict[str, Any]] = []
        self.lookalikes: LookalikeWatcher | None = None
        self._attempt = 0
        self._resume_said = False
        self._problem_said = False
        self._next_look = 0.0
        self._first_step_wall: float | None = None
        self._last_step: int | None = None
        self._last_step_wall: float | None = None
        self._matched = False  # the globs have matched a checkpoint
        self._saves_taken = 0  # the attempt's save records handed to the look-alike watcher

    def start(self, matched: bool) -> None:
        """At the run's start: a new invocation's warnings start empty; look-alikes are watched
        until one no glob matches is said."""
        self._set_meta(warnings=[])
        self._matched = matched
        if self.config.checkpoints.globs:
            outputs = output_dirs(self.config.command, self.cwd)
            self.lookalikes = LookalikeWatcher(self.cwd, outputs, [self.run_dir], self.pids)
            self.lookalikes.start()

    def attempt_started(self, attempt: int, checkpoint: Checkpoint | None, watch: AttemptWatch) -> None:
        self._attempt = attempt
        self._resume_said = False
        self._saves_taken = 0
        self._first_step_wall = self._last_step = self._last_step_wall = None
        if checkpoint is not None and checkpoint.step is not None:
            watch.resume = ResumeCheck(checkpoint.path, checkpoint.step)

    def tick(self, watch: AttemptWatch, index: CheckpointIndex) -> None:
        """Every loop tick, and once more when the attempt has ended."""
        self._check_resume(watch)
        if self.lookalikes is not None:  # every tick: the next attempt's watch starts a new list
            self.lookalikes.saved(watch.saved_paths[self._saves_taken:])
            self._saves_taken = len(watch.saved_paths)
        if self.lookalikes is not None and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + GLOB_EVERY
            self._check_globs(watch, index)

    def stop(self) -> None:
        if self.lookalikes is not None:
            self.lookalikes.stop()
            self.lookalikes = None

    def _check_resume(self, watch: AttemptWatch) -> None:
        verdict = watch.resume.verdict if watch.resume is not None and not self._resume_said else None
        if verdict is None:
            return
        self._resume_said = True
        if not verdict.resumed:
            self._warn(NOT_RESUMED, verdict.message(resume_hint(self.config)), path=verdict.path,
                       step=verdict.step, first_step=verdict.first_step)

    def _check_globs(self, watch: AttemptWatch, index: CheckpointIndex) -> None:
        assert self.lookalikes is not None
        if self.lookalikes.problem and not self._problem_said:  # our own trouble: said once, never fatal
            self._problem_said = True
            self._say(f"the files the script writes cannot be watched ({self.lookalikes.problem}); a --checkpoint "
                      "that matches nothing will only be said after 30 min of training")
        now = time.time()
        if watch.last_step is not None and watch.last_step != self._last_step:
            self._last_step, self._last_step_wall = watch.last_step, now
            self._first_step_wall = self._first_step_wall or now
        seen = self.lookalikes.found()
        found = sorted((f for f in seen if f.own), key=lambda f: f.written)  # only what the worker wrote
        self._matched = self._matched or bool(index.refresh())
        missing = missed(found, self.config.checkpoints.globs, self.cwd, self._matched, self._last_step_wall, now)
        if missing:  # said at once, while the attempt that wrote it runs
            message: str | None = missed_notice(self.config.checkpoints.globs, missing, self._matched, self.cwd)
            found = missing
        elif self._matched:  # the globs match what the script writes: nothing to say yet
            return
        else:
            message = unmatched_notice(self.config.checkpoints.globs, self._first_step_wall, self._last_step, now,
                                       self.cwd, self.lookalikes.roots, others=len(seen) > len(found))
        if message is None:
            return
        files = [f.path for f in found]
        self._warn(GLOB_UNMATCHED, message, globs=list(self.config.checkpoints.globs), files=files[-20:],
                   suggestion=suggest_glob(files, self.cwd) if files else None)
        self.stop()

    def _warn(self, kind: str, message: str, **data: Any) -> None:
        self._say(message)
        self._event(kind, message=message, **data)
        entry = {"kind": kind, "attempt": self._attempt, "message": message, "t": time.time()}
        self.warnings = [*self.warnings, entry][-MAX_WARNINGS:]
        self._set_meta(warnings=self.warnings)
