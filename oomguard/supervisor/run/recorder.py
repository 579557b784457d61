"""Every write the loop and its attempt make to the journal, and the listeners told of each event.

Tested in tests/unit/supervisor/lifecycle/test_outcome.py and tests/e2e/test_outcome.py (plan changes, stops).

The loop and ``run/attempt.py`` say what happened here, never through the journal directly: an
event goes to the journal under the attempt in progress and to the listeners (hooks, the dashboard),
whose failures are a degradation and never the run's end (``guarded``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oomguard.supervisor.decide.policy import Plan, PlanChange
from oomguard.supervisor.decide.recovery import Note
from oomguard.supervisor.lifecycle.outcome import Outcome
from oomguard.supervisor.lifecycle.states import RunState
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.record.journal import Degradations, Journal
from oomguard.supervisor.record.picture import closing

Listener = Callable[[str, dict[str, Any]], None]


class Recorder:
    def __init__(self, degradations: Degradations, attempt: Callable[[], int]) -> None:
        self.journal: Journal  # opened with the run (``Supervisor.open``)
        self.degradations = degradations
        self.listeners: list[Listener] = []
        self._attempt = attempt  # the attempt in progress (0 before the first)

    def guarded(self, component: str, action: Callable[..., object], *args: Any) -> None:
        """Run one observer or hook; its failure (EMFILE, a full disk, a bug) is a degradation, not our end."""
        try:
            action(*args)
        except Exception as exc:  # supervision of a healthy worker outlives any observer
            self.degradations.failed(component, exc)
        else:
            self.degradations.recovered(component)

    def emit(self, name: str, data: dict[str, Any]) -> None:
        for listener in self.listeners:
            self.guarded("listeners", listener, name, data)  # a dashboard or notifier bug never stops us

    def event(self, name: str, /, **data: Any) -> None:
        self.journal.event(name, self._attempt() or None, **data)
        self.emit(name, data)

    def notes(self, notes: Sequence[Note], say: Callable[[str], None]) -> None:
        """A recovery's notes (``decide/recovery.py``), in the order it took them."""
        for note in notes:
            if note.name is not None:
                self.event(note.name, **note.data)
            if note.say is not None:
                say(note.say)

    def meta(self, **values: Any) -> None:
        """What ``oomguard status`` and the dashboard show of the run now."""
        self.journal.set_meta(**values)

    def transition(self, old: RunState, new: RunState, reason: str) -> None:
        self.journal.transition(old.value, new.value, reason, self._attempt() or None)
        self.emit("state", {"from": old.value, "to": new.value, "reason": reason})

    def plan_change(self, change: PlanChange, before: int) -> None:
        """A change of plan with its source and reason (``decide/policy.py``); ``before``: the micro-batch it left."""
        b = change.plan.batch
        self.event("plan_change", source=change.source.value, reason=change.reason, micro_batch=b.micro_batch,
                   grad_accum=b.grad_accum, global_batch=b.global_batch, world_size=b.world_size,
                   from_micro_batch=before, expandable_segments=change.plan.expandable_segments)

    def attempt_started(self, pgid: int, plan: Plan, checkpoint: Checkpoint | None, argv: list[str],
                        log: Path) -> None:
        """The attempt's row, opened once its worker runs, and where it resumes from."""
        self.journal.start_attempt(self._attempt(), pgid, plan.as_dict(), checkpoint.path if checkpoint else None,
                                   argv, str(log))
        if checkpoint is not None:
            self.event("resume_point", path=checkpoint.path, step=checkpoint.step, step_from=checkpoint.step_from)

    def sample(self, sample: MemorySample, step: int | None, progress: dict[str, Any] | None) -> None:
        self.journal.record_sample(self._attempt(), sample.as_row(), sample.wall, sample.worker_rss_bytes,
                                   sample.worker_gpu_bytes, step, progress)

    def checkpoint_bad(self, path: str, load_error: str | None) -> None:
        """A checkpoint that failed to load: the next attempt resumes from the one before."""
        self.journal.mark_bad(path, load_error or "load failed")
        self.event("checkpoint_bad", path=path, evidence=load_error)

    def end_attempt(self, outcome: Outcome, decision: str, **facts: Any) -> None:
        """The attempt's row is closed here and only here, with how it ended and why it was stopped."""
        watch = outcome.watch
        self.journal.end_attempt(self._attempt(), returncode=outcome.returncode, ending=outcome.ending.value,
                                 stop_reason=outcome.stop.reason.value if outcome.stop else None,
                                 decision=decision, last_step=watch.last_step, peak_rss=watch.peak_rss,
                                 peak_allocated=watch.allocator.allocated_peak, **facts)

    def close_interrupted(self, say: Callable[[str], None]) -> None:
        """Attempts a killed supervisor left open (``ended`` NULL) are closed as interrupted, timed by
        their own last event."""
        stops = self.journal.event_data("stop_requested")  # the user had asked this attempt to stop
        for row in self.journal.attempts():
            if row["ended"] is None:
                stop = stops.get(row["attempt"])
                close = closing(stop)
                self.journal.end_attempt(row["attempt"], decision=close.decision, ending=close.ending.value,
                                         stop_reason=close.stop_reason.value if close.stop_reason else None,
                                         ended=self.journal.last_activity(row["attempt"]))
                self.journal.event("attempt_interrupted", row["attempt"], pid=row["pid"], stopped=bool(stop))
                say(f"attempt {row['attempt']} was interrupted by the end of its supervisor; closed as "
                    + ("stopped by the user" if stop else "interrupted"))
