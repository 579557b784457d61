"""The supervisor's loop: restore the run, then start an attempt, dispatch on how it ended, carry out what follows.

Read ``_loop`` and ``_dispatch`` first: they are the whole run. ``run/attempt.py`` starts, watches and stops
one attempt and returns one ``Outcome``; ``decide/recovery.py``'s pure ``recover`` decides what follows a
failure. This file carries those out: the only code that changes the run's state (``_transition``) or its
plan (``_replan``), writing the journal through one ``Recorder``. Signals and the dashboard only set flags.
Tested in tests/e2e/test_supervisor.py and tests/unit/supervisor/test_lifecycle.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from oomguard.supervisor import lifecycle
from oomguard.supervisor.command import Edit, check_edits
from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide import policy as replan
from oomguard.supervisor.decide.policy import Decision, Failure, Plan, PlanChange
from oomguard.supervisor.decide.recovery import decision_event, recover
from oomguard.supervisor.distributed.coordination import EXIT_PEER_LOST, PeerLost
from oomguard.supervisor.lifecycle import Ending, Outcome, RunState, StopReason, UsageError
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.record.journal import Degradations, Journal, ResilientJournal
from oomguard.supervisor.record.logs import say as log
from oomguard.supervisor.record.picture import stopped_by
from oomguard.supervisor.run.attempt import Attempt, TrendWatch, render
from oomguard.supervisor.run.containment import remove_stale
from oomguard.supervisor.run.process import AttemptFiles, alloc_conf, expandable_already
from oomguard.supervisor.run.runparts import ControlFlags, Recorder, RunLock, RunParts


class Supervisor:
    def __init__(self, config: RunConfig) -> None:
        self.run_dir, self.cwd = config.run_dir.resolve(), Path.cwd()
        out = sys.stdout.buffer
        self.echo: Callable[[bytes], None] = lambda raw: (out.write(raw), out.flush()) and None
        self.state = RunState.STARTING
        self.plan = Plan(config.initial_plan, eval_micro_batch=config.initial_eval_micro_batch,
                         num_workers=config.batch.num_workers)
        self.attempt = 0
        # This invocation's failures, oldest first: the policy's history. A new invocation starts a new
        # budget; a run that failed yesterday must not make today's first crash a crash loop.
        self.failures: list[Failure] = []
        self.tickers: list[Callable[[], object]] = []  # called every loop tick (e.g. systemd watchdog)
        self.degradations = Degradations(log)  # our own bookkeeping failing: said once, never fatal
        self.record = Recorder(self.degradations, lambda: self.attempt)
        self.listeners = self.record.listeners
        self.current: Attempt | None = None  # the attempt in progress (or the last one)
        self.edits: list[Edit] = []  # --edit, checked when the run opens
        self._lock = RunLock(self.run_dir)
        self.control = ControlFlags()  # signals and requests: flags only, the loop acts
        self.parts = RunParts.build(config, self.plan, self.cwd, self.record, self.control, self.tickers)

    @property
    def config(self) -> RunConfig:
        return self.parts.config

    @property
    def journal(self) -> Journal:
        return self.record.journal

    @property
    def last_sample(self) -> MemorySample | None:
        return self.parts.last_sample

    @property
    def trend(self) -> TrendWatch:
        """The current attempt's memory trend and forecast (an empty one before the first attempt)."""
        return self.current.trend if self.current is not None else TrendWatch()

    # --- restore -------------------------------------------------------------------------------

    def open(self) -> None:
        """Claim the run directory and restore what an earlier supervisor left there."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise UsageError("--run-dir", f"cannot write {self.run_dir}: {exc.strerror}",
                             "choose a directory you can write") from None
        self.edits = check_edits(self.config.batch.edits, self.config.command, self.cwd)  # exit 2 before anything runs
        self._lock.acquire()
        remove_stale()  # memory cgroups that killed supervisors could not remove
        self.record.journal = ResilientJournal(self.run_dir, self.degradations)
        meta = self.journal.meta()
        self.attempt = int(meta.get("attempt", 0))
        self.record.close_interrupted()  # first: timed by the attempt's own last event, not by ours below
        if (saved := replan.continue_saved(self.plan, meta.get("plan"))) is not None:
            self._replan(saved)
            log(f"continuing run in {self.run_dir} at micro-batch {self.plan.batch.micro_batch} "
                f"(attempt {self.attempt} so far)")
        if meta.get("state"):
            self.state = RunState(meta["state"])
        self._replan(self.parts.learn(self.plan, fresh=not meta.get("plan")))
        self.record.meta(config=self.config.to_json(), supervisor_pid=os.getpid(), run_dir=str(self.run_dir),
                         supervisor_started=psutil.Process().create_time(), started=time.time(), worker_pid=None)

    # --- the one place the state changes, the one place the plan changes ----------------------

    def _transition(self, new: RunState, reason: str) -> None:
        lifecycle.check_transition(self.state, new)
        old, self.state = self.state, new
        self.record.transition(old, new, reason)
        log(f"{new.value}: {reason}")

    def _replan(self, change: PlanChange | None) -> None:
        """Every change of plan comes from ``decide/`` with its reason, journaled as a ``plan_change`` event."""
        if change is not None:
            before, self.plan = self.plan.batch, change.plan
            self._save_plan()
            self.record.plan_change(change, before.micro_batch)

    def _save_plan(self) -> None:
        self.record.meta(attempt=self.attempt, plan=self.plan.as_dict())

    # --- signals and control (flags only) -----------------------------------------------------

    def install_signal_handlers(self) -> None:
        self.control.install_signal_handlers()

    def request_stop(self) -> None:
        self.control.request_stop()

    def request_restart(self) -> None:
        self.control.request("restart")

    def request_checkpoint(self) -> None:
        self.control.request("checkpoint")

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until the worker succeeds, the policy gives up, or we are stopped."""
        self.parts.start()
        try:
            code = self._loop()
            self.parts.world.finish()
            return code
        except PeerLost as exc:  # another node or node 0's store is gone: one line, a code to requeue on
            if self.state is RunState.RUNNING:
                self._transition(RunState.RECOVERING, f"attempt {self.attempt}: lost contact with the other nodes")
            self._transition(RunState.FAILED, str(exc))
            return EXIT_PEER_LOST
        finally:
            if self.current is not None:
                self.current.stop(StopReason.SHUTDOWN, "the supervisor is leaving")
            self.parts.close()
            self._lock.release()

    def _loop(self) -> int:
        self._transition(RunState.STARTING, f"supervisor pid {os.getpid()} started")
        if (joined := self.parts.world.connect()) is not None:
            log(joined)
        while True:
            if self.control.stopping:  # between attempts (in backoff, or before the first)
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
            return self._finished(outcome)
        decision = self._recover(outcome)  # RUNNING -> RECOVERING
        if not decision.restart:  # RECOVERING -> FAILED
            self._transition(RunState.FAILED, decision.reason)
            return lifecycle.EXIT_UNFIXABLE if decision.unfixable else lifecycle.EXIT_GAVE_UP
        if decision.delay > 0:  # RECOVERING -> BACKOFF
            self._transition(RunState.BACKOFF, decision.reason)
            self.parts.sleep(decision.delay)
        if not self.control.stopping:  # RECOVERING/BACKOFF -> STARTING
            self._transition(RunState.STARTING, f"starting attempt {self.attempt + 1}")
        return None

    def _run_attempt(self) -> Outcome:
        """Start one attempt from the newest checkpoint at the current plan, and watch it to its end."""
        self.attempt += 1
        self._save_plan()
        checkpoint = self._resume_point()
        files = AttemptFiles.of(self.run_dir, self.attempt)
        argv, env = render(self.parts, self.plan, self.attempt, checkpoint, files, self.edits)
        self._replan(replan.allocator_from_environment(self.plan, expandable_already(env)))
        self.record.meta(alloc_conf=alloc_conf(env))  # status shows what the worker got
        current = self.current = Attempt(self.parts, self.attempt, self.plan, checkpoint, files, self.trend)
        current.start(argv, env, self.echo)
        self._transition(RunState.RUNNING, f"attempt {self.attempt}: {self.plan.batch.describe()}"
                         + (f", resuming from {checkpoint.path}" if checkpoint else ""))
        return current.watch_to_end()

    def _resume_point(self) -> Checkpoint | None:
        """The newest valid checkpoint (node 0's plan and checkpoint, with several nodes), with its step."""
        resume, world = self.parts.resume, self.parts.world
        node0_plan, checkpoint, agreed = world.start_round(self.plan, resume.newest())
        self._replan(replan.agreed(self.plan, node0_plan))
        if agreed:  # every node: node 0's plan and checkpoint
            self._save_plan()
        return resume.confirmed(checkpoint)

    # --- after an attempt: one function per ending ---------------------------------------------

    def _finished(self, outcome: Outcome) -> int:
        if not self.trend.leaking():  # a leaking attempt's peak is where the leak got to
            self.parts.fitted(self.plan.batch.micro_batch, outcome.watch)
        self.record.end_attempt(outcome, "finished", exit_code=0)
        self._transition(RunState.SUCCEEDED, f"worker finished (attempt {self.attempt})")
        return 0

    def _grow(self, outcome: Outcome) -> None:
        assert outcome.stop is not None and outcome.stop.grow_to is not None
        self.parts.fitted(self.plan.batch.micro_batch, outcome.watch)
        why = "model changed" if outcome.stop.reason is StopReason.MODEL else "grow"
        change = replan.grow(self.plan, outcome.stop.grow_to, why)
        self.record.end_attempt(outcome, change.reason)
        self._replan(change)
        self._transition(RunState.STARTING, change.reason)

    def _restart_planned(self, outcome: Outcome) -> None:
        """Stopped right after a checkpoint for the forecast (or the user's restart): same size, no failure."""
        reason = outcome.stop.detail if outcome.stop else "planned restart"
        if (leak := self.trend.planned_restart(self.plan.batch.micro_batch)) is not None:
            self.record.event("attribution", **leak.as_dict(), planned=True)
        change = replan.planned_restart(self.plan, reason)
        self.record.end_attempt(outcome, reason)
        self._replan(change)
        self._transition(RunState.STARTING, change.reason)

    def _stopped(self, outcome: Outcome | None) -> int:
        """The user's stop: the attempt (if one ran) is closed now, as stopped, not as a failure."""
        sig = self.control.stop_signal or signal.SIGTERM
        if outcome is not None:
            self.record.end_attempt(outcome, stopped_by(sig), exit_code=outcome.verdict.exit_code,
                                    signal=outcome.verdict.signal)
        self._transition(RunState.STOPPED, f"stopped by {signal.Signals(sig).name}")
        return 128 + sig

    def _recover(self, outcome: Outcome) -> Decision:
        """A failure: the recovery decides (``decide/recovery.py``), node 0 agrees, the loop carries it out."""
        verdict, current = outcome.verdict, self.current
        assert verdict.kind is not None and current is not None
        self._transition(RunState.RECOVERING,
                         f"attempt {self.attempt} ended: {verdict.kind.value} ({verdict.evidence})")
        found = recover(current.facts(outcome), self.failures, self.plan, self.parts.tuner,
                        self.parts.recovery_config)
        failure = found.failure
        if failure.own is None:
            self.parts.spares.after_failure(verdict.kind, verdict.signal)
        self.parts.learned(found, self.trend)
        self.record.notes(found.notes)
        decision = self.parts.world.decision(found.decision)
        self.failures.append(failure)
        self.record.end_attempt(outcome, decision.reason, exit_code=verdict.exit_code, signal=verdict.signal,
                                kind=verdict.kind.value, evidence=verdict.evidence)
        if decision.bad_checkpoint:
            self.record.checkpoint_bad(decision.bad_checkpoint, outcome.watch.scanner.load_error)
        self.record.event("decision", **decision_event(decision, failure))
        # This node's own failure: node 0's decision carries none of ours.
        if failure.own is not None and found.decision.turn_off is failure.own.addition:
            self.parts.turn_off(failure.own, self.attempt)
        self._replan(replan.after_failure(decision))
        return decision

    def close(self) -> None:
        self.journal.close()
