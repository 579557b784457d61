"""Which checkpoint an attempt resumes from: the newest valid one, with the step it holds.

The index (``observe/checkpoints.py``) finds checkpoints; this adds what the journal knows of them:
the ones marked bad (a load that failed), and the steps an earlier supervisor on this run
directory saw them written at.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.checkpoints import Checkpoint, CheckpointIndex
from oomguard.supervisor.record.console import say as log
from oomguard.supervisor.run.recorder import Recorder


class ResumePoints:
    def __init__(self, index: CheckpointIndex, record: Recorder, cwd: Path) -> None:
        self.index = index
        self.record = record
        self.cwd = cwd

    def newest(self) -> Checkpoint | None:
        """The newest valid checkpoint now; the ones known before an attempt are not its progress."""
        checkpoint = self.index.newest(self.bad(), worker_alive=False)
        for existing in self.index.refresh():
            self.record.journal.checkpoint_seen(existing.path, existing.step, existing.mtime, None)
        return checkpoint

    def confirmed(self, checkpoint: Checkpoint | None) -> Checkpoint | None:
        """The chosen checkpoint (node 0's, with several nodes) as it is now, with its step."""
        checkpoint = self._still_there(checkpoint)
        if checkpoint is not None and checkpoint.step is None:  # one an earlier supervisor on this run saw written
            step = self._step_from_journal(checkpoint)
            checkpoint = replace(checkpoint, step=step, step_from=ckptstep.JOURNAL if step is not None else None)
        return checkpoint

    def bad(self) -> set[str]:
        """The checkpoints still bad. A mark is for one write: a script that resumed from the one
        before rewrites the torn file whole when it gets there again (same name, newer mtime), and
        that write is judged on its own; keeping the mark would resume from an older one for ever."""
        bad = set()
        for path, marked in self.record.journal.bad_marks().items():
            try:
                now = (self.cwd / path).stat().st_mtime
            except OSError:
                bad.add(path)  # gone, or unreadable: still not a resume point
                continue
            if now > marked and marked > 0:
                self.record.journal.clear_bad(path, now)
                self.record.event("checkpoint_rewritten", path=path)
            else:
                bad.add(path)
        return bad

    def _still_there(self, checkpoint: Checkpoint | None) -> Checkpoint | None:
        """The chosen checkpoint, or where rotation (HF's save_total_limit) deleted it since it was
        chosen, the newest one that exists, said in the journal."""
        found = self.index.still_there(checkpoint, self.bad())
        if checkpoint is not None and found != checkpoint:
            self.record.event("resume_point_vanished", path=checkpoint.path, fallback=found.path if found else None)
            log(f"{checkpoint.path} is gone; resuming from {found.path if found else 'the start'} instead")
        return found

    def _step_from_journal(self, checkpoint: Checkpoint) -> int | None:
        """The step journaled for a checkpoint the index knows none for (its evidence was seen by an
        earlier supervisor on this run directory: a save record, the output when it was written)."""
        return next((c["step"] for c in self.record.journal.checkpoints() if c["path"] == checkpoint.path), None)
