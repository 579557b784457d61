"""The supervisor's event loop: start an attempt, watch it, classify its end, carry out the policy.

The loop owns all mutable state and is the only code that changes the run's state
(``_transition``) or its plan (``_replan``, with a ``decide.replan.PlanChange``). An attempt ends as
one ``Outcome`` whose ``Ending`` the loop dispatches on; the worker is stopped only through
``_stop_worker(reason)``, and the reason is journaled with the attempt. Signal handlers and the
dashboard only set flags (``run.control``) and wake the loop.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import psutil

from oomguard.common import protocol
from oomguard.supervisor.command.configedit import Edit, apply_edits, check_edits
from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide import classify as unfixable
from oomguard.supervisor.decide import replan
from oomguard.supervisor.decide.attribution import Attribution, Cause, Evidence, earlier_plateaus, step_peaks
from oomguard.supervisor.decide.classify import Addition, FailureKind, OwnFault, Verdict, at_oom, own_fault
from oomguard.supervisor.decide.policy import Decision, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.decide.replan import PlanChange
from oomguard.supervisor.distributed.coordination import EXIT_PEER_LOST, PeerLost
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.lifecycle.outcome import Outcome, Stop, ending_of, grace
from oomguard.supervisor.lifecycle.states import (
    EXIT_GAVE_UP,
    EXIT_UNFIXABLE,
    Ending,
    RunState,
    StopReason,
    check_transition,
)
from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.allocator import ProbeReport
from oomguard.supervisor.observe.checkpoints import Checkpoint, CheckpointIndex, StepEvidence
from oomguard.supervisor.observe.progress import AttemptWatch, ChannelReader, StepMatcher
from oomguard.supervisor.observe.sampler import MemoryAction, MemorySample, Sampler, Thresholds, evaluate
from oomguard.supervisor.record.console import say as log
from oomguard.supervisor.record.durable import write_atomic
from oomguard.supervisor.record.fitstore import FitStore, JobKey
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.report import closing_decision, stopped_by
from oomguard.supervisor.record.resilient import Degradations, ResilientJournal
from oomguard.supervisor.run.containment import Containment, Handover, remove_stale
from oomguard.supervisor.run.control import ControlFlags, RunLock
from oomguard.supervisor.run.process import WorkerProcess
from oomguard.supervisor.run.runtime import (
    OWN_CODE,
    AttemptFiles,
    alloc_conf,
    build_argv,
    build_env,
    expandable_already,
    placeholder_values,
)
from oomguard.supervisor.run.spare import Spares
from oomguard.supervisor.run.trendwatch import ForecastBoard, TrendWatch
from oomguard.supervisor.run.wiringwatch import WiringWatch
from oomguard.supervisor.run.world import World
from oomguard.supervisor.sizing import tuning as extrapolate
from oomguard.supervisor.sizing.memmodel import OomFigures, fit
from oomguard.supervisor.sizing.trend import Move
from oomguard.supervisor.sizing.tuning import ModelPrint, SizeTuner, figures_at_oom

TICK = 0.5  # seconds between checks while a worker runs; exits, signals and requests wake the loop at once
THIN_EVERY = 300.0  # seconds between downsampling passes over the journal's samples


@dataclass
class Current:
    """The attempt in progress: its worker, what is learned while it runs, and the one reason
    oomguard stopped it (``None`` while it runs on its own)."""

    files: AttemptFiles
    checkpoint: Checkpoint | None
    watch: AttemptWatch
    trend: TrendWatch
    worker: WorkerProcess | None = None
    stop: Stop | None = None
    additions: frozenset[Addition] = frozenset()  # oomguard's own code in the worker: the probe, a spare's
    handover_lost: str | None = None  # the spare it was handed to had exited already: why (run/spare.py)


class Chores:
    """What every loop tick does besides watching the worker: the hooks' tickers, keeping the spares,
    publishing what is degraded (for ``oomguard status``), thinning the journal's samples now and then."""

    def __init__(self, tickers: list[Callable[[], object]]) -> None:
        self.tickers = tickers
        self._next_thin = time.monotonic() + THIN_EVERY
        self._published = 0

    def tick(self, sup: Supervisor) -> None:
        for ticker in self.tickers:
            sup.guarded("tickers", ticker)  # an ops hook must never stop supervision
        sup.guarded("spare", sup.spares.tick)  # the reserve starts once the spare before it has imported
        if sup.degradations.version != self._published:
            self._published = sup.degradations.version
            sup.journal.set_meta(degraded=sup.degradations.active())
        if time.monotonic() >= self._next_thin:
            self._next_thin = time.monotonic() + THIN_EVERY
            sup.journal.thin_samples()


_NO_TREND = TrendWatch()  # what ``Supervisor.trend`` shows before the first attempt


class Supervisor:
    def __init__(self, config: RunConfig, console: BinaryIO | None = None) -> None:
        self.config = config
        self.run_dir = config.run_dir.resolve()
        self.cwd = Path.cwd()
        out = console if console is not None else sys.stdout.buffer
        self.echo: Callable[[bytes], None] = lambda raw: (out.write(raw), out.flush()) and None
        self.state = RunState.STARTING
        self.plan = Plan(config.initial_plan, eval_micro_batch=config.initial_eval_micro_batch,
                         num_workers=config.num_workers)
        self.attempt = 0
        self.failures: list[Failure] = []
        self.control = ControlFlags()  # signals and requests: flags only, the loop acts
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.tickers: list[Callable[[], object]] = []  # called every loop tick (e.g. systemd watchdog)
        self.journal: Journal
        self.degradations = Degradations(log)  # our own bookkeeping failing: said once, never fatal
        self.current: Current | None = None  # the attempt in progress (or the last one)
        self.last_sample: MemorySample | None = None
        self.index = CheckpointIndex(config.checkpoints, self.cwd)
        self.sampler = Sampler()
        self.tuner = SizeTuner(self.plan.batch.per_process_batch, config.min_micro_batch,
                           margin=max(0.0, 1.0 - config.soft_threshold), memory_limit=config.memory_limit)
        self.world = World(config.dist_shape, config.peer_timeout, self._event)  # ranks and nodes
        self.handover = Handover(self._event, log)  # between attempts: leftovers, GPU memory, a fresh cgroup
        self.spares = Spares(config.spare, self.run_dir, self.cwd, config.memory_limit, self._event,
                             say=lambda doc: self.journal.set_meta(spare=doc))
        self.edits: list[Edit] = []  # --edit, checked when the run opens
        self.probe_off: str | None = None  # why the probe is off since an attempt it failed (decide/classify.py)
        self._lock = RunLock(self.run_dir)
        self._chores = Chores(self.tickers)
        self._board: ForecastBoard
        self.wiring = WiringWatch(config, self.cwd, self.run_dir, log, self._event,  # resumes, globs that miss
                                  lambda **values: self.journal.set_meta(**values),
                                  lambda: self.last_sample.worker_pids if self.last_sample else ())

    @property
    def trend(self) -> TrendWatch:
        """The current attempt's memory trend and forecast."""
        return self.current.trend if self.current is not None else _NO_TREND

    # --- setup ---------------------------------------------------------------------------------

    def open(self) -> None:
        """Claim the run directory and load what an earlier supervisor left there."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise UsageError("--run-dir", f"cannot write {self.run_dir}: {exc.strerror}",
                             "choose a directory you can write") from None
        self.edits = check_edits(self.config.edits, self.config.command, self.cwd)  # exit 2 before anything runs
        self._lock.acquire()
        remove_stale(log)  # memory cgroups that killed supervisors could not remove
        self.journal = ResilientJournal(self.run_dir, self.degradations)
        self._board = ForecastBoard(self.journal.set_meta)
        fresh = not self.journal.meta().get("plan")
        self._restore()
        self._learn(fresh)
        proc = psutil.Process()
        self.journal.set_meta(config=self.config.to_json(), supervisor_pid=os.getpid(),
                              supervisor_started=proc.create_time(), run_dir=str(self.run_dir),
                              started=time.time(), worker_pid=None)

    def _restore(self) -> None:
        meta = self.journal.meta()
        self.attempt = int(meta.get("attempt", 0))
        self._close_interrupted()  # first: timed by the attempt's own last event, not by ours below
        if (saved := replan.continue_saved(self.plan, meta.get("plan"))) is not None:
            self._replan(saved)
            log(f"continuing run in {self.run_dir} at micro-batch {self.plan.batch.micro_batch} "
                f"(attempt {self.attempt} so far)")
        # A new invocation starts a new failure budget; the earlier failures stay in the journal and
        # the report, but a run that failed yesterday must not make today's first crash a crash loop.
        self.failures = []
        if meta.get("state"):
            self.state = RunState(meta["state"])

    def _close_interrupted(self) -> None:
        """Attempts a killed supervisor left open (``ended`` NULL) are closed as interrupted."""
        stops = self.journal.event_data("stop_requested")  # the user had asked this attempt to stop
        for row in self.journal.attempts():
            if row["ended"] is None:
                stop = stops.get(row["attempt"])
                self.journal.end_attempt(row["attempt"], decision=closing_decision(stop),
                                         ending=(Ending.STOPPED if stop else Ending.INTERRUPTED).value,
                                         stop_reason=StopReason.USER.value if stop else None,
                                         ended=self.journal.last_activity(row["attempt"]))
                self.journal.event("attempt_interrupted", row["attempt"], pid=row["pid"], stopped=bool(stop))
                log(f"attempt {row['attempt']} was interrupted by the end of its supervisor; closed as "
                    + ("stopped by the user" if stop else "interrupted"))

    def _learn(self, fresh: bool) -> None:
        """Load what this run, and earlier runs of the same job, learned about memory."""
        unfit = {n for n, d in self.journal.event_data("attribution").items() if not Cause(d["cause"]).fits_model}
        rows = [a for a in self.journal.attempts() if a["attempt"] not in unfit]
        self.tuner.points = SizeTuner.points_from_attempts(rows)
        self.last_sample = self.sampler.sample(None)
        gpus = tuple((g.name, g.total_bytes) for g in self.last_sample.gpus)
        if self.last_sample.gpu_unavailable:
            log(f"no GPU figures: {self.last_sample.gpu_unavailable}")
        self.tuner.store = FitStore()
        self.tuner.key = JobKey.for_run(self.config.command, self.cwd, [*self.index.directories(), self.run_dir], gpus,
                                        self.config.world_size, self.tuner.capacity(self.last_sample))
        may_shrink = fresh and self.config.may_shrink  # a script that cannot accumulate keeps its size
        start = self.tuner.starting_micro(self.plan.batch.micro_batch) if may_shrink else None
        if (change := replan.start_at_fitted(self.plan, start, self.tuner.key.describe(), bool(gpus))) is not None:
            self._replan(change)
            log(f"an earlier run of this job fitted micro-batch {start}: starting there")

    def _save_plan(self) -> None:
        self.journal.set_meta(attempt=self.attempt, plan=self.plan.as_dict())

    # --- the one place the state changes, the one place the plan changes ----------------------

    def _transition(self, new: RunState, reason: str) -> None:
        check_transition(self.state, new)
        old, self.state = self.state, new
        self.journal.transition(old.value, new.value, reason, self.attempt or None)
        self._emit("state", {"from": old.value, "to": new.value, "reason": reason})
        log(f"{new.value}: {reason}")

    def _replan(self, change: PlanChange | None) -> None:
        """Every change of plan comes from ``decide/`` (``policy.decide`` or ``decide.replan``) with its
        reason, and is journaled here as a ``plan_change`` event."""
        if change is None:
            return
        before, self.plan = self.plan.batch, change.plan
        self._save_plan()
        b = change.plan.batch
        self._event("plan_change", source=change.source.value, reason=change.reason, micro_batch=b.micro_batch,
                    grad_accum=b.grad_accum, global_batch=b.global_batch, world_size=b.world_size,
                    from_micro_batch=before.micro_batch, expandable_segments=change.plan.expandable_segments)

    def _emit(self, name: str, data: dict[str, Any]) -> None:
        for listener in self.listeners:
            self.guarded("listeners", listener, name, data)  # a dashboard or notifier bug never stops us

    def _event(self, name: str, /, **data: Any) -> None:
        self.journal.event(name, self.attempt or None, **data)
        self._emit(name, data)

    # --- signals and control (flags only) -----------------------------------------------------

    def install_signal_handlers(self) -> None:
        self.control.install_signal_handlers()

    def request_stop(self) -> None:
        self.control.request_stop()

    def request_restart(self) -> None:
        self.control.request("restart")

    def request_checkpoint(self) -> None:
        self.control.request("checkpoint")

    @property
    def stopping(self) -> bool:
        return self.control.stopping

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until the worker succeeds, the policy gives up, or we are stopped."""
        self.index.start()
        self.wiring.start(bool(self.index.refresh()))
        try:
            code = self._loop()
            self.world.finish()
            return code
        except PeerLost as exc:  # another node or node 0's store is gone: one line, a code to requeue on
            if self.state is RunState.RUNNING:
                self._transition(RunState.RECOVERING, f"attempt {self.attempt}: lost contact with the other nodes")
            self._transition(RunState.FAILED, str(exc))
            return EXIT_PEER_LOST
        finally:
            self._stop_worker(StopReason.SHUTDOWN, "the supervisor is leaving")
            self.spares.discard()
            self.wiring.stop()
            self.index.stop()
            self.sampler.close()
            self.handover.remove()
            self.journal.set_meta(worker_pid=None, rank_pids={})
            self._lock.release()

    def _loop(self) -> int:
        self._transition(RunState.STARTING, f"supervisor pid {os.getpid()} started")
        if (joined := self.world.connect()) is not None:
            log(joined)
        while True:
            if self.stopping:  # between attempts (in backoff, or before the first)
                return self._stopped(None)
            code = self._dispatch(self._run_attempt())
            if code is not None:
                return code

    def _dispatch(self, outcome: Outcome) -> int | None:
        """Carry out what follows from how the attempt ended; the exit code once the run is over."""
        ending = outcome.ending
        if ending is Ending.STOPPED:  # RUNNING -> STOPPED: the user's stop, never a failure
            return self._stopped(outcome)
        if ending is Ending.PLANNED_RESTART:  # RUNNING -> STARTING, the same plan
            self._restart_planned(outcome)
            return None
        if ending is Ending.GROW:  # RUNNING -> STARTING, a larger micro-batch
            self._grow(outcome)
            return None
        if ending is Ending.FINISHED:  # RUNNING -> SUCCEEDED
            self._finished(outcome)
            return 0
        decision = self._recover(outcome)  # RUNNING -> RECOVERING
        if not decision.restart:  # RECOVERING -> FAILED
            self._transition(RunState.FAILED, decision.reason)
            return EXIT_UNFIXABLE if decision.unfixable else EXIT_GAVE_UP
        if decision.delay > 0:  # RECOVERING -> BACKOFF
            self._transition(RunState.BACKOFF, decision.reason)
            self._sleep(decision.delay)
        if not self.stopping:  # RECOVERING/BACKOFF -> STARTING
            self._transition(RunState.STARTING, f"starting attempt {self.attempt + 1}")
        return None

    def _end_attempt(self, outcome: Outcome, decision: str, **facts: Any) -> None:
        """The attempt's row is closed here and only here, with how it ended and why it was stopped."""
        worker = self.current.worker if self.current is not None else None
        self.journal.end_attempt(self.attempt, returncode=worker.returncode if worker else None,
                                 ending=outcome.ending.value,
                                 stop_reason=outcome.stop.reason.value if outcome.stop else None,
                                 decision=decision, last_step=outcome.watch.last_step,
                                 peak_rss=outcome.watch.peak_rss, peak_allocated=outcome.watch.allocator.allocated_peak,
                                 **facts)

    def _finished(self, outcome: Outcome) -> None:
        if not self.trend.leaking():  # a leaking attempt's peak is where the leak got to
            self.tuner.record(self.plan.batch.micro_batch, self._peak(outcome.watch), memory_failed=False)
        self._end_attempt(outcome, "finished", exit_code=0)
        self._transition(RunState.SUCCEEDED, f"worker finished (attempt {self.attempt})")

    def _grow(self, outcome: Outcome) -> None:
        assert outcome.stop is not None and outcome.stop.grow_to is not None
        self.tuner.record(self.plan.batch.micro_batch, self._peak(outcome.watch), memory_failed=False)
        why = "model changed" if outcome.stop.reason is StopReason.MODEL else "grow"
        change = replan.grow(self.plan, outcome.stop.grow_to, why)
        self._end_attempt(outcome, change.reason)
        self._replan(change)
        self._transition(RunState.STARTING, change.reason)

    def _restart_planned(self, outcome: Outcome) -> None:
        """The worker was stopped right after a checkpoint, because the forecast put the limit before
        the checkpoint after it (or the user asked for a restart): the same size, no failure."""
        trend = self.trend
        reason = outcome.stop.detail if outcome.stop else "planned restart"
        per_s = trend.forecast.per_s if trend.forecast else trend.prior_per_s
        attribution = trend.attribute(Evidence(), self.plan.batch.micro_batch)
        if attribution.cause is Cause.LEAK:
            self._event("attribution", **attribution.as_dict(), planned=True)
        trend.prior_per_s = per_s
        change = replan.planned_restart(self.plan, reason)
        self._end_attempt(outcome, reason)
        self._replan(change)
        self._transition(RunState.STARTING, change.reason)

    def _peak(self, watch: AttemptWatch) -> int | None:
        return self.tuner.peak_bytes(watch.peak, self.last_sample, watch.allocator)

    def _stopped(self, outcome: Outcome | None) -> int:
        """The user's stop: the attempt (if one ran) is closed now, as stopped, not as a failure."""
        sig = self.control.stop_signal or signal.SIGTERM
        reason = f"stopped by {signal.Signals(sig).name}"
        if outcome is not None:
            self._end_attempt(outcome, stopped_by(sig), exit_code=outcome.verdict.exit_code,
                              signal=outcome.verdict.signal)
        self._transition(RunState.STOPPED, reason)
        return 128 + sig

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self.control.sleep(min(left, TICK))
            self._chores.tick(self)

    # --- one attempt --------------------------------------------------------------------------

    def _run_attempt(self) -> Outcome:
        """Start one attempt, watch it to its end, and return how it ended."""
        self.attempt += 1
        self._save_plan()
        checkpoint = self._resume_point()
        files = AttemptFiles.of(self.run_dir, self.attempt)
        argv, env = self._render(checkpoint, files)
        previous = self.trend
        current = self.current = Current(
            files, checkpoint,
            AttemptWatch(matcher=StepMatcher(self.config.progress_pattern or None, self.plan.batch.grad_accum),
                         probe=ProbeReport.for_command(self.config.probe, self.config.command, self.probe_off)),
            TrendWatch(previous.prior_per_s, previous.checkpoint_rhythm(0.0)[1], time.monotonic()))
        self.journal.set_meta(probe=current.watch.probe.as_meta())
        self.wiring.attempt_started(self.attempt, checkpoint, current.watch)
        containment = self._start_worker(argv, env, current)
        worker = current.worker
        assert worker is not None
        self.journal.start_attempt(self.attempt, worker.pgid, self.plan.as_dict(),
                                   checkpoint.path if checkpoint else None, argv, str(files.log))
        if checkpoint is not None:
            self._event("resume_point", path=checkpoint.path, step=checkpoint.step, step_from=checkpoint.step_from)
        b = self.plan.batch
        self._transition(RunState.RUNNING, f"attempt {self.attempt}: micro-batch {b.micro_batch}"
                         f" × accumulation {b.grad_accum} × world {b.world_size} = {b.global_text}"
                         + (f", resuming from {checkpoint.path}" if checkpoint else ""))
        self._watch(current, ChannelReader(files.events))
        worker.reap()
        assert worker.returncode is not None
        facts = containment.exit_facts(worker.returncode, current.watch, current.stop)
        gpus = bool(self.last_sample and self.last_sample.gpus)
        verdict = self.world.verdict(facts, current.watch.scanner, gpus, self.attempt)
        ending = ending_of(current.stop, verdict, self.stopping)
        return Outcome(ending, verdict, current.stop, current.watch, checkpoint)

    def _resume_point(self) -> Checkpoint | None:
        """The newest valid checkpoint (node 0's, with several nodes), with the step it holds."""
        checkpoint = self.index.newest(self._bad(), worker_alive=False)
        for existing in self.index.refresh():  # known before this attempt: not its progress
            self.journal.checkpoint_seen(existing.path, existing.step, existing.mtime, None)
        node0_plan, checkpoint, agreed = self.world.start_round(self.attempt, self.plan, checkpoint)
        self._replan(replan.agreed(self.plan, node0_plan))
        checkpoint = self._still_there(checkpoint)
        if checkpoint is not None and checkpoint.step is None:  # one an earlier supervisor on this run saw written
            step = self._step_from_output(checkpoint)
            checkpoint = replace(checkpoint, step=step, step_from=ckptstep.JOURNAL if step is not None else None)
        if agreed:  # every node: node 0's plan and checkpoint
            self._save_plan()
        return checkpoint

    def _render(self, checkpoint: Checkpoint | None, files: AttemptFiles) -> tuple[list[str], dict[str, str]]:
        """The attempt's argv and environment for the current plan."""
        values = placeholder_values(self.config, self.plan, self.attempt, checkpoint)
        argv = build_argv(self.config, self.plan, values, checkpoint is not None)
        if self.edits:  # --edit: this attempt's copies of the config files, and the argv pointed at them
            argv = apply_edits(self.edits, argv, values, self.cwd, self.run_dir / "edits" / f"attempt-{self.attempt}")
        env = build_env(self.config, self.plan, values, files)
        argv = self.world.command(argv, env, files, self.attempt)
        self._replan(replan.allocator_from_environment(self.plan, expandable_already(env)))
        self.journal.set_meta(alloc_conf=alloc_conf(env))  # status shows what the worker got
        return argv, env


    def _still_there(self, checkpoint: Checkpoint | None) -> Checkpoint | None:
        """The chosen checkpoint, or where rotation (HF's save_total_limit) deleted it since it was
        chosen, the newest one that exists, said in the journal."""
        found = self.index.still_there(checkpoint, self._bad())
        if checkpoint is not None and found != checkpoint:
            self._event("resume_point_vanished", path=checkpoint.path, fallback=found.path if found else None)
            log(f"{checkpoint.path} is gone; resuming from {found.path if found else 'the start'} instead")
        return found

    def _bad(self) -> set[str]:
        """The checkpoints still bad. A mark is for one write: a script that resumed from the one
        before rewrites the torn file whole when it gets there again (same name, newer mtime), and
        that write is judged on its own; keeping the mark would resume from an older one for ever."""
        bad = set()
        for path, marked in self.journal.bad_marks().items():
            try:
                now = (self.cwd / path).stat().st_mtime
            except OSError:
                bad.add(path)  # gone, or unreadable: still not a resume point
                continue
            if now > marked and marked > 0:
                self.journal.clear_bad(path, now)
                self._event("checkpoint_rewritten", path=path)
            else:
                bad.add(path)
        return bad

    def _step_from_output(self, checkpoint: Checkpoint) -> int | None:
        """The step journaled for a checkpoint the index knows none for (its evidence was seen by an
        earlier supervisor on this run directory: a save record, the output when it was written)."""
        return next((c["step"] for c in self.journal.checkpoints() if c["path"] == checkpoint.path), None)

    def _start_worker(self, argv: list[str], env: dict[str, str], current: Current) -> Containment:
        """Start the worker in a fresh memory cgroup (a spare interpreter's, when one is taken), onto
        free memory; then a spare for the next attempt."""
        spare = self.spares.take(argv, env, lambda: self.stopping)
        containment = self.handover.next_containment(f"oomguard-{os.getpid()}-worker", self.config.memory_limit,
                                                     self.sampler.gpu, self.config.settle_timeout,
                                                     spare.containment if spare else None)
        if containment.cgroup is None and self.attempt == 1:
            log(f"no memory cgroup ({containment.why_none}); --memory-limit is enforced by watching RSS")
        current.files.checkpoint_request.unlink(missing_ok=True)
        current.worker = WorkerProcess(argv, env, self.cwd, current.files.log,
                                       self.world.line_sink(current.watch.feed_line), self.echo, containment.procs,
                                       log_max_bytes=self.config.log_max_bytes, problems=self.degradations)
        current.additions = frozenset({Addition.PROBE} if self.config.probe else set()) | (
            {Addition.SPARE} if spare else set())
        current.worker.start(self.control.wake, spare.hand_over() if spare else None)
        current.handover_lost = spare.lost if spare else None
        self.sampler.cgroup = containment.reader()
        self.journal.set_meta(worker_pid=None, rank_pids={})  # named at the first sample (run/process.py)
        self.guarded("spare", self.spares.prepare, argv, env)
        return containment

    def _stop_worker(self, reason: StopReason, detail: str, grow_to: int | None = None,
                     first: Callable[[], object] | None = None) -> None:
        """The one way oomguard stops a worker: the first reason is the attempt's (kept in the journal),
        its grace period is the reason's (``lifecycle.outcome.grace``), a second Ctrl-C cuts it short.
        ``first`` runs once the reason is recorded and before the SIGTERM (a hang's stack dump, whose
        signal may itself end the worker)."""
        current = self.current
        if current is None or current.worker is None or current.worker.exited.is_set():
            return
        if current.stop is None:
            current.stop = Stop(reason, detail, grow_to)
            self._event("worker_stop", reason=reason.value, detail=detail)
        if first is not None:
            self.guarded("stack dump", first)
        current.worker.stop(grace(reason, self.config.grace_period), lambda: self.control.forced)

    def _watch(self, current: Current, channel: ChannelReader) -> None:
        """Watch the worker until it exits: every stop it needs goes through ``_stop_worker``."""
        worker, watch = current.worker, current.watch
        assert worker is not None
        next_sample = 0.0
        while not worker.exited.is_set():
            self.control.sleep(TICK)
            self._chores.tick(self)
            if self.stopping:
                sig = signal.Signals(self.control.stop_signal or signal.SIGTERM).name
                self._event("stop_requested", signal=sig)  # a later supervisor closing it knows it was the user's
                self._stop_worker(StopReason.USER, f"stopped by {sig}")
                break
            if self.control.take("restart"):
                self._stop_worker(StopReason.RESTART, "restart requested")
                break
            self.guarded("channel", self._read_channel, current, channel)
            if time.monotonic() >= next_sample:
                next_sample = time.monotonic() + self.config.sample_interval
                self.guarded("sampling", self._sample, current)
                self.guarded("checkpoints", self._check_checkpoints, current)
            if self.control.take("checkpoint"):
                self.guarded("checkpoint request", self._ask_for_checkpoint, current, "requested")
            self._check_hang(current)
            self._check_peers()
            self.guarded("wiring", self.wiring.tick, watch, self.index)
        self.guarded("channel", self._read_channel, current, channel)
        self.guarded("wiring", self.wiring.tick, watch, self.index)
        self._board.clear()
        self.guarded("checkpoints", self._check_checkpoints, current, False)  # its last ones may carry its last step
        if watch.progress is not None:
            self.journal.set_meta(progress={**watch.progress, "attempt": self.attempt})

    def guarded(self, component: str, action: Callable[..., object], *args: Any) -> None:
        """Run one observer or hook; its failure (EMFILE, a full disk, a bug) is a degradation, not our end."""
        try:
            action(*args)
        except Exception as exc:  # supervision of a healthy worker outlives any observer
            self.degradations.failed(component, exc)
        else:
            self.degradations.recovered(component)

    def _check_peers(self) -> None:
        """Another node's attempt failed: ours would only wait in a collective for its ranks."""
        peer = self.world.peer_failed(self.attempt)
        if peer is not None:
            log(f"node {peer} failed in round {self.attempt}; stopping this node's ranks")
            self._stop_worker(StopReason.PEER, f"node {peer} failed in round {self.attempt}")

    def _read_channel(self, current: Current, channel: ChannelReader) -> None:
        for record in channel.read():
            if current.watch.take(record, time.monotonic()):
                self._event(f"worker_{record['type']}", **{k: v for k, v in record.items() if k != "type"})
            if record["type"] == "probe":
                self.journal.set_meta(probe=current.watch.probe.as_meta())
            if record["type"] == "checkpoint" and current.trend.restart_reason:
                self._restart_now(current)  # the worker says it saved: sooner than the file settling
            if record["type"] == protocol.MODEL and (model := ModelPrint.from_record(record)) is not None:
                self._model_seen(current, model)

    def _model_seen(self, current: Current, model: ModelPrint) -> None:
        """The probe's model against the fit store's record (``SizeTuner.model_seen``): another model
        is said once, journaled with both parameter counts, and where the record made this run start
        below the size asked for, the worker is restarted there now (a larger micro-batch, the global
        batch kept: the ``--grow`` path). With several nodes each node's store may hold its own
        record, so the run goes on and only the record is replaced."""
        change = self.tuner.model_seen(model, self.plan.batch.micro_batch)
        if change is None:
            return
        # A record read after the worker exited, or while it is being stopped for another reason: no restart.
        running = current.worker is not None and not current.worker.exited.is_set() and current.stop is None
        restart_at = change.restart_at if self.world.nodes is None and running else None
        self._event("model_changed", params=change.now.params, measured_params=change.then.params,
                    digest=change.now.digest, measured_digest=change.then.digest, restart_at=restart_at)
        log(replace(change, restart_at=restart_at).text)
        if restart_at is not None:
            self._stop_worker(StopReason.MODEL, f"model changed: micro-batch {restart_at}, the size asked for",
                              grow_to=restart_at)

    def _restart_now(self, current: Current) -> None:
        """Carry out the planned restart: stop the worker (a SIGTERM a preemption-aware script
        answers by saving) right after a checkpoint."""
        self._stop_worker(StopReason.PLANNED, current.trend.restart_reason or "planned restart")

    def _sample(self, current: Current) -> None:
        """One memory sample: journal it, fold the attempt's peak, act on the thresholds."""
        worker, watch = current.worker, current.watch
        assert worker is not None
        sample = self.sampler.sample(worker.worker_pid or worker.pgid)
        self.handover.procs.add(worker.tree())
        if (named := worker.named_pids()) is not None:  # the training process and ranks, for status
            self.journal.set_meta(**named)
        self.last_sample = sample
        watch.observe(sample)  # its peaks, and what its processes did since the last sample
        worker_bytes = sample.cgroup.working_set_bytes if sample.cgroup else sample.worker_rss_bytes
        if worker_bytes is not None:  # the spares' budget: their room is what the worker's peak leaves
            self.spares.observe(worker_bytes, watch.last_step is not None, sample.worker_pids)
        self.journal.record_sample(self.attempt, sample.as_row(), sample.wall, sample.worker_rss_bytes,
                                   sample.worker_gpu_bytes, watch.last_step, watch.progress)
        watch.progress = None
        pending = watch.request_pending(current.files.checkpoint_request.exists(), time.monotonic())
        thresholds = Thresholds(self.config.soft_threshold, self.config.psi_threshold, self.config.memory_limit)
        verdict = evaluate(sample, thresholds, pending)
        if verdict.action is MemoryAction.STOP and current.stop is None:
            why = verdict.evidence or verdict.reason
            log(f"stopping the worker: {why}")
            self._stop_worker(StopReason.MEMORY, why)
        elif verdict.action is MemoryAction.CHECKPOINT:
            watch.last_request = time.monotonic()
            self._ask_for_checkpoint(current, f"{verdict.reason} ({verdict.evidence})")
        self._foresee(sample, current)
        self._consider_growth(current)

    def _foresee(self, sample: MemorySample, current: Current) -> None:
        """Forecast when a steady rise reaches the limit; when that comes before the checkpoint
        after next, restart right after the next one (asking for it when the limit is nearer)."""
        trend = current.trend
        forecast = trend.add(sample, current.watch.last_step, self.config.memory_limit, self.config.soft_threshold,
                             current.watch.allocator.reading())
        self._board.show(forecast)
        if forecast is None or forecast.move is Move.WATCH or not self.config.checkpoints:
            return  # without checkpoints a restart would redo everything: the forecast is only shown
        if trend.restart_reason is None:
            trend.restart_reason = f"planned restart after the next checkpoint: {forecast.text}"
            self._event("planned_restart", reason=trend.restart_reason, budget=forecast.budget,
                        seconds_to_limit=round(forecast.seconds_to_limit, 1), bytes_per_s=round(forecast.per_s),
                        limit=forecast.limit, move=forecast.move.value)
            log(trend.restart_reason)
        if forecast.move is Move.CHECKPOINT_NOW and not trend.asked:
            trend.asked = True
            current.watch.last_request = time.monotonic()
            self._ask_for_checkpoint(current, f"memory forecast: {forecast.text}")

    def _consider_growth(self, current: Current) -> None:
        """--grow: after a stable period, plan a larger micro-batch the model predicts fits; the
        restart waits for the next checkpoint so no work is lost."""
        watch = current.watch
        stable = time.monotonic() - watch.running_since() >= self.config.grow_after
        if not (self.config.grow and self.config.checkpoints and stable) or watch.grow_to is not None:
            return
        micro = self.plan.batch.micro_batch
        prediction = self.tuner.growth(micro, self._peak(watch), self.last_sample)
        if prediction is not None:
            watch.grow_to = prediction.micro_batch
            self._event("grow_planned", micro_batch=prediction.micro_batch, from_micro_batch=micro,
                        predicted_bytes=prediction.predicted_peak, why=prediction.reason)
            log(f"--grow: micro-batch {prediction.micro_batch} predicted to fit ({prediction.reason}); "
                "restarting at the next checkpoint")

    def _check_checkpoints(self, current: Current, worker_alive: bool = True) -> None:
        """Journal new checkpoints. While the worker runs only settled ones count; once it has
        exited nothing is being written, so the last ones it wrote count too."""
        watch = current.watch
        bad = self._bad()
        found = self.index.settled(bad) if worker_alive else [
            c for c in self.index.refresh(force=True) if c.path not in bad]
        for ckpt in found:
            evidence = self._checkpoint_step(ckpt, watch)
            step = evidence.step
            if self.journal.checkpoint_seen(ckpt.path, step, ckpt.mtime, self.attempt):
                watch.checkpoint_landed(step, time.monotonic(), time.time())
                self._event("checkpoint", path=ckpt.path, step=step, step_from=evidence.source)
                current.trend.checkpoint_seen(time.monotonic())
                if current.trend.restart_reason and worker_alive:
                    self._restart_now(current)
                if watch.grow_to is not None:
                    self._stop_worker(StopReason.GROW, f"--grow: micro-batch {watch.grow_to} after {ckpt.path}",
                                      grow_to=watch.grow_to)

    def _checkpoint_step(self, ckpt: Checkpoint, watch: AttemptWatch) -> StepEvidence:
        """The step ``ckpt`` holds, from the best evidence (observe/checkpoints.py), taught to the index
        so that the choice of the newest one to resume from goes by it too."""
        if ckpt.step_from == ckptstep.SAVE:  # learned from this write's save record already
            return StepEvidence(ckpt.step, ckpt.step_from)
        saved = watch.saved_step(ckpt.path, ckpt.mtime, os.path.isdir(ckpt.path))
        by_time = watch.step_at(ckpt.mtime) if saved is None and ckpt.step is None else None
        evidence = ckptstep.resolve(saved, StepEvidence(ckpt.step, ckpt.step_from), by_time)
        self.index.learn(ckpt, evidence)
        return evidence

    def _ask_for_checkpoint(self, current: Current, why: str) -> None:
        """The request file is always written (scripts poll it); the signal only goes to a worker
        that handles it."""
        assert current.worker is not None
        write_atomic(current.files.checkpoint_request, f"{time.time()} {why}\n")
        sig = signal.Signals[self.config.checkpoint_signal]
        sent = current.worker.send_if_handled(sig)
        self._event("checkpoint_request", reason=why, signal=sig.name if sent else None)

    def _check_hang(self, current: Current) -> None:
        worker, watch = current.worker, current.watch
        assert worker is not None
        if current.stop is not None:
            return  # already being stopped: a worker on its way out is quiet
        now = time.monotonic()
        judgement = watch.check_hang(worker.last_output, self.config.hang_timeout, now)
        if judgement is None:
            return
        news = watch.liveness.news(judgement, now)
        if news is not None:  # silent but busy, or no longer: status, the dashboard and the journal say why
            self.journal.set_meta(liveness=judgement.note(self.attempt, time.time()))
            if news == "held":
                self._event("held_alive", **judgement.figures)
                log(f"worker {judgement.held}: not a hang")
        if judgement.hung is None:
            return
        hung = judgement.hung
        self._event("hang", **judgement.figures)
        log(f"worker hung: {hung}; dumping its stack")
        self._stop_worker(StopReason.HANG, hung, first=worker.dump_stack)

    # --- after an attempt ---------------------------------------------------------------------

    def _recover(self, outcome: Outcome) -> Decision:
        verdict, watch = outcome.verdict, outcome.watch
        assert verdict.kind is not None
        self._transition(RunState.RECOVERING, f"attempt {self.attempt} ended: {verdict.kind.value}"
                         f" ({verdict.evidence})")
        current = self.current
        # Our own code failed it (decide/classify.py): nothing it shows is the script's, nor its memory's.
        own = own_fault(verdict.kind, watch.scanner, current.additions, OWN_CODE,
                        current.handover_lost) if current is not None else None
        if own is None:
            self.spares.after_failure(verdict.kind, verdict.signal)
        failure, attribution = self._failure(outcome, own)
        fits = own is None and (attribution is None or attribution.cause.fits_model)  # leaks, spikes stay out
        if fits:
            self.tuner.record(failure.micro_batch, self._peak(watch), memory_failed=verdict.kind.is_memory)
        oom = self._figures_at_oom(outcome) if own is None else None
        # Address space under RLIMIT_AS proves nothing: threads' stacks and malloc arenas mapped after the
        # first forward are counted as if they followed the batch. Only the prediction may use it.
        proof = oom if oom is not None and not oom.address_space else None
        hint = (self.tuner.shrink_hint(failure.micro_batch, self.last_sample, proof)
                if verdict.kind.is_memory and fits else None)
        if hint is not None:
            self._event("memory_model", micro_batch=hint.micro_batch, predicted_bytes=hint.predicted_peak,
                        why=hint.reason)
        decision = decide(failure, self.failures, self.plan, _policy_config(self.config),
                          fit_hint=hint.micro_batch if hint else None)
        turn_off = decision.turn_off  # this node's own failure: node 0's agreed decision carries none of ours
        if self.config.predict_shrink and verdict.kind.is_memory and fits:
            decision = self._predicted(decision, failure.micro_batch, oom)
        decision = self.world.decision(self.attempt, decision)
        self.failures.append(failure)
        self._end_attempt(outcome, decision.reason, exit_code=verdict.exit_code, signal=verdict.signal,
                          kind=verdict.kind.value, evidence=verdict.evidence)
        if decision.bad_checkpoint:
            self.journal.mark_bad(decision.bad_checkpoint, watch.scanner.load_error or "load failed")
            self._event("checkpoint_bad", path=decision.bad_checkpoint, evidence=watch.scanner.load_error)
        self._event("decision", action=decision.action.value, reason=decision.reason,
                    micro_batch=decision.plan.batch.micro_batch, grad_accum=decision.plan.batch.grad_accum,
                    kind=verdict.kind.value, evidence=verdict.evidence,
                    cause=attribution.cause.value if attribution else None)
        if failure.own is not None and turn_off is failure.own.addition:
            self._turn_off(failure.own)
        self._replan(replan.after_failure(decision))
        return decision

    def _turn_off(self, own: OwnFault) -> None:
        """The policy found the attempt died in oomguard's own code: the attempts after it run without
        that addition, as under --no-probe or --no-spare; said once, journaled once."""
        if own.addition is Addition.PROBE:
            self.config = replace(self.config, probe=False)  # build_env leaves the probe's PYTHONPATH out
            self.probe_off = own.off(self.attempt)
        else:
            self.spares.turn_off()
        self._event("own_failure", addition=own.addition.value, frame=own.frame, reason=own.reason,
                    off=own.off(self.attempt))
        log(own.reason)

    def _figures_at_oom(self, outcome: Outcome) -> OomFigures | None:
        """The probe's figures at a memory failure (a CUDA OOM's allocator, a host OOM's address space
        under RLIMIT_AS), which the tuner also learns the fixed memory and the limit from."""
        kind, allocator = outcome.verdict.kind, outcome.watch.allocator
        if kind not in (FailureKind.CUDA_OOM, FailureKind.HOST_OOM):
            return None
        cuda = allocator.oom if kind is FailureKind.CUDA_OOM else None
        progress = allocator.progress
        if progress is not None and (progress.memory == "cuda_allocated") != (kind is FailureKind.CUDA_OOM):
            progress = None  # a record of the other device's OOM (one the script caught): not this failure's
        oom = figures_at_oom(cuda, self.plan.batch.micro_batch, progress)
        if oom is not None and (self.config.predict_shrink or not oom.address_space):
            self.tuner.learn(oom)  # the address-space model serves the prediction and the growth after it only
        return oom

    def _predicted(self, decision: Decision, failed_micro: int, oom: OomFigures | None) -> Decision:
        """--predict-shrink: the decision taken down to the size the OOM's figures predict to fit, when
        that is below what the proven path chose; journaled with the prediction's reason."""
        prediction = extrapolate.predict_after_oom(oom, decision.plan.batch.micro_batch,
                                                   self.plan.batch.per_process_batch, self.tuner.margin,
                                                   self.config.min_micro_batch,
                                                   [*self.tuner.stored_failures, *self.tuner.points])
        jumped = extrapolate.jump(decision, failed_micro, prediction)
        if jumped is not decision and prediction is not None:
            self._event("memory_prediction", micro_batch=prediction.micro_batch, from_micro_batch=failed_micro,
                        proven_micro_batch=decision.plan.batch.micro_batch, predicted_bytes=prediction.predicted_peak,
                        why=prediction.reason)
            log(f"--predict-shrink: {prediction.reason}")
        return jumped

    def _failure(self, outcome: Outcome, own: OwnFault | None) -> tuple[Failure, Attribution | None]:
        """The failure as the policy sees it: kind, size, fragmentation and cause (none where ``own``)."""
        verdict, watch, checkpoint = outcome.verdict, outcome.watch, outcome.checkpoint
        assert verdict.kind is not None
        scan = watch.scanner
        load_error = checkpoint is not None and scan.load_error is not None and not watch.progressed
        fragmentation = at_oom(watch.allocator.oom, scan.tried_bytes, scan.reserved_unallocated, scan.capacity_bytes,
                               self.tuner.predicted_gpu_peak(self.plan.batch.micro_batch, self.last_sample))
        if verdict.kind is FailureKind.CUDA_OOM and (scan.tried_bytes is not None or watch.allocator.oom is not None):
            self._event("fragmentation", fragmented=fragmentation.fragmented, why=fragmentation.why)
        attribution = self._attribute(verdict, watch) if own is None else None
        failure = Failure(self.attempt, verdict.kind, self.plan.batch.micro_batch, verdict.evidence,
                          fragmentation.fragmented, watch.new_checkpoint,
                          checkpoint.path if checkpoint else None, load_error, attribution,
                          unfixable.seen(scan, verdict.exit_code, watch.progressed), own)
        return failure, attribution

    def _exited_at(self) -> float | None:
        """When the worker's exit was seen (monotonic): the moment of the failure the trend must explain."""
        worker = self.current.worker if self.current is not None else None
        return worker.exited_at if worker is not None else None

    def _attribute(self, verdict: Verdict, watch: AttemptWatch) -> Attribution | None:
        """The cause of a memory failure, journaled with the figures that decided it."""
        if verdict.kind is None or not verdict.kind.is_memory:
            return None
        scan, alloc = watch.scanner, watch.allocator.oom if verdict.kind is FailureKind.CUDA_OOM else None
        capacity = scan.allowed_bytes or (alloc.limit if alloc is not None and alloc.fraction else None)
        progress = watch.allocator.progress
        # The probe saw an allocation fail against the address-space limit, and the worker died of that
        # error (not of a kernel kill after an RLIMIT_AS error the script caught).
        rlimit = progress if verdict.kind is FailureKind.HOST_OOM and verdict.signal is None \
            and progress is not None and progress.memory == "address_space" else None
        attribution = self.trend.attribute(Evidence(tuple(scan.frames), tuple(scan.tail), scan.dataloader,
                                                    capacity, alloc, step_peaks(self.journal.attempts()), rlimit),
                                           self.plan.batch.micro_batch, fit(self.tuner.points), verdict.kind,
                                           self._exited_at(), earlier_plateaus(self.journal.event_data("attribution"),
                                                                               self.journal.attempts()))
        if attribution.cause is Cause.LEAK and (rate := attribution.figures.get("bytes_per_s")):
            self.trend.prior_per_s = float(rate)
        self._event("attribution", **attribution.as_dict())
        log(f"cause: {attribution.summary}")
        return attribution

    def close(self) -> None:
        self.journal.close()


def _policy_config(config: RunConfig) -> PolicyConfig:
    return PolicyConfig(config.min_micro_batch, config.max_restarts, config.backoff, config.max_backoff,
                        len(config.fallback_args), config.allow_smaller_global_batch)
