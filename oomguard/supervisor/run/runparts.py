"""What the run keeps from one attempt to the next, and what every loop tick does besides watching.

Tested in tests/e2e/test_outcome.py (bad checkpoints, resume points, plan changes, stops),
tests/e2e/test_supervisor.py, tests/e2e/test_operator.py and tests/e2e/test_wiring.py.

The loop builds one ``RunParts`` and hands it to each attempt (``run/attempt.py``): the config, the
``Recorder`` (every journal write, and the listeners told of each event; their failures are a
degradation, never the run's end), the ``ControlFlags`` (signals and the dashboard only set a flag and
wake the loop, uvicorn's rule; a second SIGINT/SIGTERM cuts the grace period short), the observers
(checkpoints, memory, wiring), the actors (spares, the handover, the other nodes) and the memory knowledge.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide import policy as replan
from oomguard.supervisor.decide.attribution import Cause
from oomguard.supervisor.decide.classify import Addition, OwnFault
from oomguard.supervisor.decide.policy import Plan, PlanChange, PolicyConfig
from oomguard.supervisor.decide.recovery import Note, Recovery, RecoveryConfig
from oomguard.supervisor.lifecycle import STOP_SIGNALS, Outcome, RunState, UsageError
from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.allocator import BreakdownWatch
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
from oomguard.supervisor.observe.sampler import MemorySample, Sampler
from oomguard.supervisor.record.fitstore import FitStore, JobKey
from oomguard.supervisor.record.journal import Degradations, Journal
from oomguard.supervisor.record.logs import say as log
from oomguard.supervisor.record.picture import closing
from oomguard.supervisor.run.containment import Handover
from oomguard.supervisor.run.preflight import resume_hint
from oomguard.supervisor.run.spare import Spares
from oomguard.supervisor.run.world import World
from oomguard.supervisor.sizing.memmodel import Point, SizeTuner
from oomguard.supervisor.sizing.trend import Forecast

if TYPE_CHECKING:
    from oomguard.supervisor.run.attempt import TrendWatch

TICK = 0.5  # seconds between checks while a worker runs; exits, signals and requests wake the loop at once
THIN_EVERY = 300.0  # seconds between downsampling passes over the journal's samples


Listener = Callable[[str, dict[str, Any]], None]


@dataclass
class Recorder:
    degradations: Degradations
    _attempt: Callable[[], int]  # the attempt in progress (0 before the first)
    listeners: list[Listener] = field(default_factory=list)
    journal: Journal = field(init=False)  # opened with the run (``Supervisor.open``)

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

    def notes(self, notes: Sequence[Note]) -> None:
        """A recovery's notes (``decide/recovery.py``), in the order it took them."""
        for note in notes:
            if note.name is not None:
                self.event(note.name, **note.data)
            if note.say is not None:
                log(note.say)

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

    def close_interrupted(self) -> None:
        """Attempts a killed supervisor left open are closed as interrupted, timed by their last event."""
        stops = self.journal.event_data("stop_requested")  # the user had asked this attempt to stop
        for row in self.journal.attempts():
            if row["ended"] is None:
                stop = stops.get(row["attempt"])
                close = closing(stop)
                self.journal.end_attempt(row["attempt"], decision=close.decision, ending=close.ending.value,
                                         stop_reason=close.stop_reason.value if close.stop_reason else None,
                                         ended=self.journal.last_activity(row["attempt"]))
                self.journal.event("attempt_interrupted", row["attempt"], pid=row["pid"], stopped=bool(stop))
                log(f"attempt {row['attempt']} was interrupted by the end of its supervisor; closed as "
                    + ("stopped by the user" if stop else "interrupted"))


class ControlFlags:
    def __init__(self) -> None:
        self.wake = threading.Event()
        self.stop_signals = 0  # SIGINT/SIGTERM count; the second forces an immediate kill
        self.stop_signal: int | None = None
        self._requests: set[str] = set()
        self._lock = threading.Lock()

    def install_signal_handlers(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_stop_signal)
        signal.signal(signal.SIGHUP, lambda signum, frame: self.wake.set())  # a closed terminal must not end a run

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signals += 1
        self.stop_signal = signum
        self.wake.set()

    def request_stop(self) -> None:
        self._on_stop_signal(signal.SIGTERM, None)

    def request(self, what: str) -> None:
        """``restart`` or ``checkpoint``: taken by the loop at its next tick."""
        with self._lock:
            self._requests.add(what)
        self.wake.set()

    def take(self, what: str) -> bool:
        """True once for each request made since the last time it was taken."""
        with self._lock:
            taken = what in self._requests
            self._requests.discard(what)
            return taken

    @property
    def stopping(self) -> bool:
        return self.stop_signals > 0

    @property
    def forced(self) -> bool:
        """A second stop signal: do not wait for the worker's grace period."""
        return self.stop_signals > 1

    def sleep(self, seconds: float) -> None:
        """Wait for a wake-up or ``seconds``, whichever comes first."""
        self.wake.wait(seconds)
        self.wake.clear()


# One supervisor per run directory: an exclusive flock held for the supervisor's lifetime.
#
# The kernel drops the lock when the process dies, ``kill -9`` included, so a stale lock file never
# blocks the next start.


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "supervisor.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError("--run-dir", f"{self.path.parent} is already supervised by pid {holder}",
                             f"stop that supervisor (oomguard stop --run-dir {shlex.quote(str(self.path.parent))}) "
                             "or choose another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


NOT_RESUMED = "not_resumed"
GLOB_UNMATCHED = "checkpoint_glob_unmatched"
WARNING_EVENTS = (NOT_RESUMED, GLOB_UNMATCHED)
MAX_WARNINGS = 20  # kept for status; the journal keeps every event
GLOB_EVERY = 1.0  # seconds between looks at the globs and the look-alikes


@dataclass
class WiringWatch:
    """What only shows while the script runs, said at once and once (console, journal, the meta's
    ``warnings``, webhooks): ``not_resumed``, an attempt whose first step is no resume from its
    checkpoint; ``checkpoint_glob_unmatched``, a file the worker wrote (its ``save`` record, or open
    for writing) that looks like a checkpoint and no glob matches, or globs that match nothing while
    it trains and writes nothing like one."""

    config: RunConfig
    cwd: Path
    run_dir: Path
    event: Callable[..., None]
    set_meta: Callable[..., None]
    pids: Callable[[], Sequence[int]]  # the worker's processes, as last sampled: whose open files are its writes
    warnings: list[dict[str, Any]] = field(default_factory=list)
    lookalikes: LookalikeWatcher | None = None
    _attempt: int = 0
    _resume_said: bool = False
    _problem_said: bool = False
    _next_look: float = 0.0
    _first_step_wall: float | None = None
    _last_step: int | None = None
    _last_step_wall: float | None = None
    _matched: bool = False  # the globs have matched a checkpoint
    _saves_taken: int = 0  # the attempt's save records handed to the look-alike watcher

    def start(self, matched: bool) -> None:
        """A new invocation's warnings start empty; look-alikes are watched until one is said."""
        self.set_meta(warnings=[])
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
            log(f"the files the script writes cannot be watched ({self.lookalikes.problem}); a --checkpoint "
                "that matches nothing will only be said after 30 min of training")
        now, globs = time.time(), self.config.checkpoints.globs
        if watch.last_step is not None and watch.last_step != self._last_step:
            self._last_step, self._last_step_wall = watch.last_step, now
            self._first_step_wall = self._first_step_wall or now
        seen = self.lookalikes.found()
        found = sorted((f for f in seen if f.own), key=lambda f: f.written)  # only what the worker wrote
        self._matched = self._matched or bool(index.refresh())
        missing = missed(found, globs, self.cwd, self._matched, self._last_step_wall, now)
        if missing:  # said at once, while the attempt that wrote it runs
            message: str | None = missed_notice(globs, missing, self._matched, self.cwd)
            found = missing
        elif self._matched:  # the globs match what the script writes: nothing to say yet
            return
        else:
            message = unmatched_notice(globs, self._first_step_wall, self._last_step, now,
                                       self.cwd, self.lookalikes.roots, others=len(seen) > len(found))
        if message is None:
            return
        files = [f.path for f in found]
        self._warn(GLOB_UNMATCHED, message, globs=list(globs), files=files[-20:],
                   suggestion=suggest_glob(files, self.cwd) if files else None)
        self.stop()

    def _warn(self, kind: str, message: str, **data: Any) -> None:
        log(message)
        self.event(kind, message=message, **data)
        entry = {"kind": kind, "attempt": self._attempt, "message": message, "t": time.time()}
        self.warnings = [*self.warnings, entry][-MAX_WARNINGS:]
        self.set_meta(warnings=self.warnings)


@dataclass
class ForecastBoard:
    """The forecast in the meta: rewritten at most every 5 seconds, at once when it appears or goes."""

    set_meta: Callable[..., None]
    _written: float = 0.0
    _shown: bool = False

    def show(self, found: Forecast | None) -> None:
        now = time.monotonic()
        if found is None and not self._shown:
            return
        if found is not None and self._shown and now - self._written < 5.0:
            return
        self._written = now
        self._shown = found is not None
        self.set_meta(forecast=None if found is None else {
            "text": found.text, "seconds_to_limit": round(found.seconds_to_limit, 1),
            "bytes_per_s": round(found.per_s), "budget": found.budget, "limit": found.limit,
            "move": found.move.value, "t": time.time()})

    def clear(self) -> None:
        """The forecast ends with its attempt; the next one's first is shown at once (attempts can be short)."""
        self._shown = False
        self.set_meta(forecast=None)


# Which checkpoint an attempt resumes from: the newest valid one, with the step it holds.
#
# The index (``observe/checkpoints.py``) finds checkpoints; this adds what the journal knows of them:
# the ones marked bad (a load that failed), and the steps an earlier supervisor on this run
# directory saw them written at.

@dataclass
class ResumePoints:
    index: CheckpointIndex
    record: Recorder
    cwd: Path

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
            # the step an earlier supervisor on this run directory journaled for it
            step = next((c["step"] for c in self.record.journal.checkpoints() if c["path"] == checkpoint.path), None)
            checkpoint = replace(checkpoint, step=step, step_from=ckptstep.JOURNAL if step is not None else None)
        return checkpoint

    def bad(self) -> set[str]:
        """The checkpoints still bad. A mark is for one write: a torn file rewritten whole (newer mtime) is
        judged on its own, or the run would resume from an older one for ever."""
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
        """The chosen checkpoint, or the newest left where rotation deleted it since (said in the journal)."""
        found = self.index.still_there(checkpoint, self.bad())
        if checkpoint is not None and found != checkpoint:
            self.record.event("resume_point_vanished", path=checkpoint.path, fallback=found.path if found else None)
            log(f"{checkpoint.path} is gone; resuming from {found.path if found else 'the start'} instead")
        return found



@dataclass
class RunParts:
    config: RunConfig  # replaced (not changed) when an addition of ours is turned off
    cwd: Path
    run_dir: Path
    record: Recorder
    control: ControlFlags
    resume: ResumePoints
    sampler: Sampler
    tuner: SizeTuner  # the memory knowledge: replaced by what a recovery learned
    world: World
    handover: Handover
    spares: Spares
    wiring: WiringWatch
    board: ForecastBoard
    tickers: list[Callable[[], object]]  # called every loop tick (e.g. the systemd watchdog)
    last_sample: MemorySample | None = None
    probe_off: str | None = None  # why the probe is off since an attempt it failed (decide/ownfault.py)
    # what filled memory, per rank and attempt (observe/allocator.py; record/memoryparts.py words it)
    breakdowns: BreakdownWatch = field(default_factory=BreakdownWatch)
    _next_thin: float = field(default_factory=lambda: time.monotonic() + THIN_EVERY)
    _published: int = 0  # the degradations' version last put in the meta

    @classmethod
    def build(cls, config: RunConfig, plan: Plan, cwd: Path, record: Recorder, control: ControlFlags,
              tickers: list[Callable[[], object]]) -> RunParts:
        run_dir, event, meta = config.run_dir.resolve(), record.event, record.meta
        tuner = SizeTuner(plan.batch.per_process_batch, config.batch.min_micro_batch,
                          margin=max(0.0, 1.0 - config.memory.soft_threshold), memory_limit=config.memory.memory_limit)
        spares = Spares(config.spare, run_dir, cwd, config.memory.memory_limit, event, say=lambda doc: meta(spare=doc))
        parts: RunParts
        wiring = WiringWatch(config, cwd, run_dir, event, meta,  # resumes, globs that miss
                             lambda: parts.last_sample.worker_pids if parts.last_sample else ())
        index = CheckpointIndex(config.checkpoints.globs, cwd)
        # the world: ranks and nodes; an elastic run's host takes a node back in after the next checkpoint
        world = World(config.dist_shape, config.distributed.peer_timeout, event, index, lambda: control.stopping)
        parts = cls(config, cwd, run_dir, record, control, ResumePoints(index, record, cwd), Sampler(), tuner, world,
                    Handover(event), spares, wiring, ForecastBoard(meta), tickers)
        return parts

    def tick(self) -> None:
        """Every tick besides watching: the hooks' tickers, the spares, what is degraded, thinning the samples."""
        record = self.record
        for ticker in self.tickers:
            record.guarded("tickers", ticker)  # an ops hook must never stop supervision
        record.guarded("spare", self.spares.tick)  # the reserve starts once the spare before it has imported
        if record.degradations.version != self._published:
            self._published = record.degradations.version
            record.meta(degraded=record.degradations.active())
        if time.monotonic() >= self._next_thin:
            self._next_thin = time.monotonic() + THIN_EVERY
            record.journal.thin_samples()

    def sleep(self, seconds: float) -> None:
        """Wait between attempts (a backoff), doing the chores, until a stop is asked for."""
        deadline = time.monotonic() + seconds
        while not self.control.stopping and (left := deadline - time.monotonic()) > 0:
            self.control.sleep(min(left, TICK))
            self.tick()

    def start(self) -> None:
        """The run's watchers start: checkpoints, and the wiring (the globs, resumes)."""
        self.resume.index.start()
        self.wiring.start(bool(self.resume.index.refresh()))

    def close(self) -> None:
        """The supervisor is leaving: no spare, watcher or cgroup of ours stays behind."""
        for leave in (self.spares.discard, self.wiring.stop, self.resume.index.stop, self.sampler.close,
                      self.handover.remove):
            leave()
        self.record.meta(worker_pid=None, rank_pids={})

    @property
    def recovery_config(self) -> RecoveryConfig:
        c = self.config
        return RecoveryConfig(PolicyConfig(c.batch.min_micro_batch, c.liveness.max_restarts, c.liveness.backoff,
                                           c.liveness.max_backoff,
                                           len(c.batch.fallback_args), c.batch.allow_smaller_global_batch),
                              c.batch.predict_shrink)

    def fitted(self, micro_batch: int, watch: AttemptWatch) -> None:
        """An attempt ended without a memory failure at ``micro_batch``: a point the size fits at."""
        self.tuner.record(micro_batch, self.tuner.peak_bytes(watch.peak, self.last_sample, watch.allocator),
                          memory_failed=False)

    def turn_off(self, own: OwnFault, attempt: int) -> None:
        """The attempt died in oomguard's own code: later ones run without that addition; said once."""
        if own.addition is Addition.PROBE:
            self.config = replace(self.config, probe=False)  # build_env leaves the probe's PYTHONPATH out
            self.probe_off = own.off(attempt)
        else:
            self.spares.turn_off()
        self.record.event("own_failure", addition=own.addition.value, frame=own.frame, reason=own.reason,
                          off=own.off(attempt))
        log(own.reason)

    def learn(self, plan: Plan, fresh: bool) -> PlanChange | None:
        """Load what this run and earlier runs of the job learned; the fit store's size for a fresh run."""
        journal, tuner, config = self.record.journal, self.tuner, self.config
        unfit = {n for n, d in journal.event_data("attribution").items() if not Cause(d["cause"]).fits_model}
        tuner.points = SizeTuner.points_from_attempts([a for a in journal.attempts() if a["attempt"] not in unfit])
        sample = self.last_sample = self.sampler.sample(None)
        gpus = tuple((g.name, g.total_bytes) for g in sample.gpus)
        if sample.gpu_unavailable:
            log(f"no GPU figures: {sample.gpu_unavailable}")
        tuner.store = FitStore()
        tuner.key = JobKey.for_run(config.command, self.cwd, [*self.resume.index.directories(), self.run_dir], gpus,
                                   config.world_size, tuner.capacity(sample))
        may_shrink = fresh and config.may_shrink  # a script that cannot accumulate keeps its size
        start = tuner.starting_micro(plan.batch.micro_batch) if may_shrink else None
        change = replan.start_at_fitted(plan, start, tuner.key.describe(), bool(gpus))
        if change is not None:
            log(f"an earlier run of this job fitted micro-batch {start}: starting there")
        return change

    def learned(self, found: Recovery, trend: TrendWatch) -> None:
        """Keep what a recovery learned: the memory knowledge (and the fit store's point), a leak's rate."""
        self.tuner = replace(found.memory, store=self.tuner.store)
        if found.point is not None:
            self._store(found.point)
        if found.leak_per_s is not None:
            trend.prior_per_s = found.leak_per_s

    def _store(self, point: Point) -> None:
        tuner = self.tuner
        if tuner.store is not None and tuner.key is not None:
            try:
                tuner.store.record(tuner.key, point, tuner.models)
            except Exception:  # the fit store is advice: the run goes on without it
                tuner.store = None
