"""The supervisor's event loop: start an attempt, watch it, classify its end, carry out the policy.

The loop owns all mutable state and is the only code that changes the run's state
(``_transition``). Signal handlers and the dashboard only set flags and wake the loop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

import psutil

from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide.attribution import Attribution, Cause, Evidence
from oomguard.supervisor.decide.classify import FailureKind, Verdict
from oomguard.supervisor.decide.fitstore import FitStore, JobKey
from oomguard.supervisor.decide.forecast import Move
from oomguard.supervisor.decide.fragmentation import judge
from oomguard.supervisor.decide.memmodel import fit
from oomguard.supervisor.decide.policy import Decision, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.decide.tuning import Tuner
from oomguard.supervisor.dist.coordination import EXIT_PEER_LOST, PeerLost
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.observe.channel import ChannelReader
from oomguard.supervisor.observe.checkpoints import Checkpoint, CheckpointIndex
from oomguard.supervisor.observe.memory import MemorySample, Sampler
from oomguard.supervisor.observe.progress import AttemptWatch
from oomguard.supervisor.observe.steps import StepMatcher
from oomguard.supervisor.observe.thresholds import Action as MemoryAction
from oomguard.supervisor.observe.thresholds import Thresholds, evaluate
from oomguard.supervisor.record.degraded import Degradations
from oomguard.supervisor.record.durable import write_atomic
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.report import CLOSED_INTERRUPTED
from oomguard.supervisor.record.resilient import ResilientJournal
from oomguard.supervisor.run.configedit import Edit, apply_edits, check_edits
from oomguard.supervisor.run.containment import Containment, remove_stale
from oomguard.supervisor.run.lock import RunLock
from oomguard.supervisor.run.process import WorkerProcess
from oomguard.supervisor.run.runtime import (
    AttemptFiles,
    alloc_conf,
    build_argv,
    build_env,
    expandable_already,
    placeholder_values,
)
from oomguard.supervisor.run.settle import Handover
from oomguard.supervisor.run.states import RunState, check_transition
from oomguard.supervisor.run.trendwatch import ForecastBoard, TrendWatch
from oomguard.supervisor.run.world import World

TICK = 0.5  # seconds between checks while a worker runs; exits, signals and requests wake the loop at once
THIN_EVERY = 300.0  # seconds between downsampling passes over the journal's samples


def _stderr(message: str) -> None:
    print(f"[oomguard] {message}", file=sys.stderr, flush=True)


# Where the supervisor's own messages go: stderr, or the terminal status line when one is shown.
log_sink: list[Callable[[str], None]] = [_stderr]


def log(message: str) -> None:
    log_sink[0](message)


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
        self.wake = threading.Event()
        self.stop_signals = 0  # SIGINT/SIGTERM count; the second forces an immediate kill
        self.stop_signal: int | None = None
        self.restart_requested = False
        self.checkpoint_requested = False
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.worker: WorkerProcess | None = None
        self.journal: Journal
        self.degradations = Degradations(log)  # our own bookkeeping failing: said once, never fatal
        self._lock = RunLock(self.run_dir)
        self.handover = Handover(self._event, log)  # between attempts: leftovers, GPU memory, a fresh cgroup
        self.index = CheckpointIndex(config.checkpoints, self.cwd)
        self.sampler = Sampler()
        self.last_sample: MemorySample | None = None
        self.thresholds = Thresholds(config.soft_threshold, config.psi_threshold, config.memory_limit)
        self.tuner = Tuner(self.plan.batch.per_process_batch, config.min_micro_batch,
                           margin=max(0.0, 1.0 - config.soft_threshold), memory_limit=config.memory_limit)
        self.edits: list[Edit] = []  # --edit, checked when the run opens
        self.tickers: list[Callable[[], object]] = []  # called every loop tick (e.g. systemd watchdog)
        self.trend = TrendWatch()  # this attempt's memory trend and forecast (a new one per attempt)
        self.forecast_board: ForecastBoard
        self._next_thin = time.monotonic() + THIN_EVERY
        self.world = World(config.dist_shape, config.peer_timeout, self._event)  # ranks and nodes
        self._published = 0

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
        self.forecast_board = ForecastBoard(self.journal.set_meta)
        fresh = not self.journal.meta().get("plan")
        self._restore()
        self._learn(fresh)
        proc = psutil.Process()
        self.journal.set_meta(config=self.config.to_json(), supervisor_pid=os.getpid(),
                              supervisor_started=proc.create_time(), run_dir=str(self.run_dir),
                              started=time.time(), worker_pid=None)

    def _restore(self) -> None:
        meta = self.journal.meta()
        resumed = self.plan.resumed(meta.get("plan"))
        if resumed is not None:
            self.plan = resumed
            log(f"continuing run in {self.run_dir} at micro-batch {resumed.batch.micro_batch} "
                f"(attempt {meta.get('attempt', 0)} so far)")
        self.attempt = int(meta.get("attempt", 0))
        self._close_interrupted()
        # A new invocation starts a new failure budget; the earlier failures stay in the journal and
        # the report, but a run that failed yesterday must not make today's first crash a crash loop.
        self.failures = []
        if meta.get("state"):
            self.state = RunState(meta["state"])

    def _close_interrupted(self) -> None:
        """Attempts a killed supervisor left open (``ended`` NULL) are closed as interrupted."""
        for row in self.journal.attempts():
            if row["ended"] is None:
                self.journal.end_attempt(row["attempt"], decision=CLOSED_INTERRUPTED)
                self.journal.event("attempt_interrupted", row["attempt"], pid=row["pid"])
                log(f"attempt {row['attempt']} was interrupted by the end of its supervisor; closed as interrupted")

    def _learn(self, fresh: bool) -> None:
        """Load what this run, and earlier runs of the same job, learned about memory."""
        unfit = {n for n, d in self.journal.event_data("attribution").items() if not Cause(d["cause"]).fits_model}
        rows = [a for a in self.journal.attempts() if a["attempt"] not in unfit]
        self.tuner.points = Tuner.points_from_attempts(rows)
        self.last_sample = self.sampler.sample(None)
        gpus = tuple((g.name, g.total_bytes) for g in self.last_sample.gpus)
        if self.last_sample.gpu_unavailable:
            log(f"no GPU figures: {self.last_sample.gpu_unavailable}")
        self.tuner.store = FitStore()
        self.tuner.key = JobKey(self.config.command, gpus, self.config.world_size)
        start = self.tuner.starting_micro(self.plan.batch.micro_batch) if fresh else None
        if start is not None:
            self.plan = replace(self.plan, batch=self.plan.batch.with_micro_batch(start))
            self.journal.event("fit_store", None, micro_batch=start, job=self.tuner.key.describe())
            log(f"an earlier run of this job fitted micro-batch {start}: starting there")

    def _save_plan(self) -> None:
        self.journal.set_meta(attempt=self.attempt, plan=self.plan.as_dict())

    # --- the one place the state changes ------------------------------------------------------

    def _transition(self, new: RunState, reason: str) -> None:
        check_transition(self.state, new)
        old, self.state = self.state, new
        self.journal.transition(old.value, new.value, reason, self.attempt or None)
        self._emit("state", {"from": old.value, "to": new.value, "reason": reason})
        log(f"{new.value}: {reason}")

    def _emit(self, name: str, data: dict[str, Any]) -> None:
        for listener in self.listeners:
            self._guarded("listeners", listener, name, data)  # a dashboard or notifier bug never stops us

    def _event(self, name: str, /, **data: Any) -> None:
        self.journal.event(name, self.attempt or None, **data)
        self._emit(name, data)

    # --- signals and control (flags only) -----------------------------------------------------

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signals += 1
        self.stop_signal = signum
        self.wake.set()

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.wake.set()  # not fatal: a closed terminal must not end an overnight run

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)

    def request_stop(self) -> None:
        self._on_stop_signal(signal.SIGTERM, None)

    def request_restart(self) -> None:
        self.restart_requested = True
        self.wake.set()

    def request_checkpoint(self) -> None:
        self.checkpoint_requested = True
        self.wake.set()

    @property
    def stopping(self) -> bool:
        return self.stop_signals > 0

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until the worker succeeds, the policy gives up, or we are stopped."""
        self.index.start()
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
            if self.worker is not None and not self.worker.exited.is_set():
                self.worker.stop(self.config.grace_period, lambda: self.stop_signals > 1)
            self.index.stop()
            self.sampler.close()
            self.handover.remove()
            self.journal.set_meta(worker_pid=None)
            self._lock.release()

    def _loop(self) -> int:
        self._transition(RunState.STARTING, f"supervisor pid {os.getpid()} started")
        if (joined := self.world.connect()) is not None:
            log(joined)
        while True:
            if self.stopping:
                return self._stopped()
            verdict, watch, checkpoint = self._run_attempt()
            if self.stopping:
                return self._stopped()
            if self.trend.restarting:  # stopped on purpose: whatever it exited with, it resumes
                self._planned_restart(watch)
                continue
            if watch.growing and watch.grow_to is not None:
                self._grow(watch.grow_to, watch)
                continue
            if verdict.kind is None:
                if not self.trend.leaking():  # a leaking attempt's peak is where the leak got to
                    self.tuner.record(self.plan.batch.micro_batch, self._peak(watch), memory_failed=False)
                self.journal.end_attempt(self.attempt, returncode=0, exit_code=0, decision="finished",
                                         last_step=watch.last_step, peak_rss=watch.peak_rss)
                self._transition(RunState.SUCCEEDED, f"worker finished (attempt {self.attempt})")
                return 0
            decision = self._recover(verdict, watch, checkpoint)
            if not decision.restart:
                self._transition(RunState.FAILED, decision.reason)
                return 1
            if decision.delay > 0:
                self._transition(RunState.BACKOFF, decision.reason)
                self._sleep(decision.delay)
            if not self.stopping:
                self._transition(RunState.STARTING, f"starting attempt {self.attempt + 1}")

    def _grow(self, micro: int, watch: AttemptWatch) -> None:
        self.tuner.record(self.plan.batch.micro_batch, self._peak(watch), memory_failed=False)
        old = self.plan.batch.micro_batch
        self.plan = replace(self.plan, batch=self.plan.batch.with_micro_batch(micro))
        reason = f"grow: micro-batch {old} -> {micro} × accumulation {self.plan.batch.grad_accum}"
        self.journal.end_attempt(self.attempt, returncode=self.worker.returncode if self.worker else None,
                                 decision=reason, last_step=watch.last_step, peak_rss=watch.peak_rss)
        self._save_plan()
        self._transition(RunState.STARTING, reason)

    def _planned_restart(self, watch: AttemptWatch) -> None:
        """The worker was stopped right after a checkpoint because the forecast put the limit
        before the checkpoint after it: restart at the same size, no failure, nothing redone."""
        reason = self.trend.restart_reason or "planned restart"
        per_s = self.trend.forecast.per_s if self.trend.forecast else self.trend.prior_per_s
        attribution = self.trend.attribute(Evidence(), self.plan.batch.micro_batch)
        if attribution.cause is Cause.LEAK:
            self._event("attribution", **attribution.as_dict(), planned=True)
        self.trend.prior_per_s = per_s
        self.journal.end_attempt(self.attempt, returncode=self.worker.returncode if self.worker else None,
                                 decision=reason, last_step=watch.last_step, peak_rss=watch.peak_rss)
        self._save_plan()
        self._transition(RunState.STARTING, f"{reason}; restarting at micro-batch {self.plan.batch.micro_batch}")

    def _peak(self, watch: AttemptWatch) -> int | None:
        return self.tuner.peak_bytes(watch.peak, self.last_sample)

    def _stopped(self) -> int:
        sig = self.stop_signal or signal.SIGTERM
        self._transition(RunState.STOPPED, f"stopped by {signal.Signals(sig).name}")
        return 128 + sig

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self.wake.wait(min(left, TICK))
            self.wake.clear()
            self._tick()

    # --- one attempt --------------------------------------------------------------------------

    def _run_attempt(self) -> tuple[Verdict, AttemptWatch, Checkpoint | None]:
        self.attempt += 1
        self._save_plan()
        checkpoint = self.index.newest(self.journal.bad_checkpoints(), worker_alive=False)
        for existing in self.index.refresh():  # known before this attempt: not its progress
            self.journal.checkpoint_seen(existing.path, existing.step, existing.mtime, None)
        self.plan, checkpoint, agreed = self.world.start_round(self.attempt, self.plan, checkpoint)
        checkpoint = self._resume_point(checkpoint)
        if checkpoint is not None and checkpoint.step is None:  # nanoGPT's ckpt.pt: {checkpoint_step} from the output
            checkpoint = replace(checkpoint, step=self._step_from_output(checkpoint))
        if agreed:  # every node: node 0's plan and checkpoint
            self._save_plan()
        files = AttemptFiles.of(self.run_dir, self.attempt)
        values = placeholder_values(self.config, self.plan, self.attempt, checkpoint)
        argv = build_argv(self.config, self.plan, values, checkpoint is not None)
        if self.edits:  # --edit: this attempt's copies of the config files, and the argv pointed at them
            argv = apply_edits(self.edits, argv, values, self.cwd, self.run_dir / "edits" / f"attempt-{self.attempt}")
        env = build_env(self.config, self.plan, values, files)
        argv = self.world.command(argv, env, files, self.attempt)
        if not self.plan.expandable_segments and expandable_already(env):
            self.plan = replace(self.plan, expandable_segments=True)
        self.journal.set_meta(alloc_conf=alloc_conf(env))  # status shows what the worker got
        watch = AttemptWatch(matcher=StepMatcher(self.config.progress_pattern or None, self.plan.batch.grad_accum))
        self.trend = TrendWatch(self.trend.prior_per_s, self.trend.checkpoint_rhythm(0.0)[1], time.monotonic())
        box = self._start_worker(argv, env, files, watch)
        assert self.worker is not None
        self.journal.start_attempt(self.attempt, self.worker.pgid, self.plan.as_dict(),
                                   checkpoint.path if checkpoint else None, argv, str(files.log))
        if checkpoint is not None:
            self._event("resume_point", path=checkpoint.path, step=checkpoint.step)
        self._transition(RunState.RUNNING, f"attempt {self.attempt}: micro-batch {self.plan.batch.micro_batch}"
                         f" × accumulation {self.plan.batch.grad_accum} × world {self.plan.batch.world_size}"
                         f" = {self.plan.batch.global_batch}"
                         + (f", resuming from {checkpoint.path}" if checkpoint else ""))
        self._watch(watch, ChannelReader(files.events), files)
        self.worker.reap()
        assert self.worker.returncode is not None
        facts = box.exit_facts(self.worker.returncode, watch)
        gpus = bool(self.last_sample and self.last_sample.gpus)
        return self.world.verdict(facts, watch.scanner, gpus, self.attempt), watch, checkpoint

    def _resume_point(self, checkpoint: Checkpoint | None) -> Checkpoint | None:
        """The chosen checkpoint, or where rotation (HF's save_total_limit) deleted it since it was
        chosen, the newest one that exists, said in the journal."""
        found = self.index.still_there(checkpoint, self.journal.bad_checkpoints())
        if checkpoint is not None and found != checkpoint:
            self._event("resume_point_vanished", path=checkpoint.path, fallback=found.path if found else None)
            log(f"{checkpoint.path} is gone; resuming from {found.path if found else 'the start'} instead")
        return found

    def _step_from_output(self, checkpoint: Checkpoint) -> int | None:
        """The step the output showed when a checkpoint without a step in its name was written."""
        return next((c["step"] for c in self.journal.checkpoints() if c["path"] == checkpoint.path), None)

    def _start_worker(self, argv: list[str], env: dict[str, str], files: AttemptFiles,
                      watch: AttemptWatch) -> Containment:
        """Start the worker in a fresh memory cgroup, onto free memory."""
        box = self.handover.next_box(f"oomguard-{os.getpid()}-worker", self.config.memory_limit, self.sampler.gpu,
                                     self.config.settle_timeout)
        if box.cgroup is None and self.attempt == 1:
            log(f"no memory cgroup ({box.why_none}); --memory-limit is enforced by watching RSS")
        files.checkpoint_request.unlink(missing_ok=True)
        self.worker = WorkerProcess(argv, env, self.cwd, files.log, self.world.line_sink(watch.feed_line), self.echo,
                                    box.procs,
                                    log_max_bytes=self.config.log_max_bytes, problems=self.degradations)
        self.worker.start(self.wake)
        self.sampler.cgroup = box.reader()
        self.journal.set_meta(worker_pid=self.worker.pgid)
        return box

    def _watch(self, watch: AttemptWatch, channel: ChannelReader, files: AttemptFiles) -> None:
        assert self.worker is not None
        next_sample = 0.0
        while not self.worker.exited.is_set():
            self.wake.wait(TICK)
            self.wake.clear()
            self._tick()
            if self.stopping or self.restart_requested:
                self.restart_requested = False
                self.worker.stop(self.config.grace_period, lambda: self.stop_signals > 1)
                break
            self._guarded("channel", self._read_channel, watch, channel)
            if time.monotonic() >= next_sample:
                next_sample = time.monotonic() + self.config.sample_interval
                self._guarded("sampling", self._sample, watch, files)
                self._guarded("checkpoints", self._check_checkpoints, watch)
            if self.checkpoint_requested:
                self.checkpoint_requested = False
                self._guarded("checkpoint request", self._ask_for_checkpoint, files, "requested")
            self._check_hang(watch)
            self._check_peers()
        self._guarded("channel", self._read_channel, watch, channel)
        self.forecast_board.clear()
        self._guarded("checkpoints", self._check_checkpoints, watch, False)  # its last ones may carry its last step
        if watch.progress is not None:
            self.journal.set_meta(progress=watch.progress)

    def _guarded(self, component: str, action: Callable[..., object], *args: Any) -> None:
        """Run one observer; its failure (EMFILE, a full disk, a bug) is a degradation, not our end."""
        try:
            action(*args)
        except Exception as exc:  # supervision of a healthy worker outlives any observer
            self.degradations.failed(component, exc)
        else:
            self.degradations.recovered(component)

    def _check_peers(self) -> None:
        """Another node's attempt failed: ours would only wait in a collective for its ranks."""
        peer = self.world.peer_failed(self.attempt)
        if peer is not None and self.worker is not None:
            log(f"node {peer} failed in round {self.attempt}; stopping this node's ranks")
            self.worker.stop(min(self.config.grace_period, 10.0))

    def _read_channel(self, watch: AttemptWatch, channel: ChannelReader) -> None:
        for record in channel.read():
            if watch.take(record, time.monotonic()):
                self._event(f"worker_{record['type']}", **{k: v for k, v in record.items() if k != "type"})
            if record["type"] == "checkpoint" and self.trend.restart_reason:
                self._restart_now()  # the worker says it saved: sooner than the file settling

    def _restart_now(self) -> None:
        """Carry out the planned restart: stop the worker (a SIGTERM a preemption-aware script
        answers by saving) right after a checkpoint."""
        if self.trend.restarting or self.worker is None or self.worker.exited.is_set():
            return
        self.trend.restarting = True
        self.worker.stop(self.config.grace_period)

    def _tick(self) -> None:
        for ticker in self.tickers:
            self._guarded("tickers", ticker)  # an ops hook must never stop supervision
        if self.degradations.version != self._published:  # what is degraded, for oomguard status
            self._published = self.degradations.version
            self.journal.set_meta(degraded=self.degradations.active())
        if time.monotonic() >= self._next_thin:
            self._next_thin = time.monotonic() + THIN_EVERY
            self.journal.thin_samples()

    def _sample(self, watch: AttemptWatch, files: AttemptFiles) -> None:
        """One memory sample: journal it, fold the attempt's peak, act on the thresholds."""
        assert self.worker is not None
        sample = self.sampler.sample(self.worker.worker_pid or self.worker.pgid)
        self.handover.procs.add(self.worker.tree())
        self.last_sample = sample
        watch.observe(sample)  # its peaks, and what its processes did since the last sample
        self.journal.record_sample(self.attempt, sample.as_row(), sample.wall, sample.worker_rss_bytes,
                                   sample.worker_gpu_bytes, watch.last_step, watch.progress)
        watch.progress = None
        pending = watch.request_pending(files.checkpoint_request.exists(), time.monotonic())
        verdict = evaluate(sample, self.thresholds, pending)
        if verdict.action is MemoryAction.STOP and watch.stopped_for_memory is None:
            watch.stopped_for_memory = verdict.evidence or verdict.reason
            log(f"stopping the worker: {watch.stopped_for_memory}")
            self.worker.stop(min(self.config.grace_period, 5.0))
        elif verdict.action is MemoryAction.CHECKPOINT:
            watch.last_request = time.monotonic()
            self._ask_for_checkpoint(files, f"{verdict.reason} ({verdict.evidence})")
        self._foresee(sample, watch, files)
        self._consider_growth(watch)

    def _foresee(self, sample: MemorySample, watch: AttemptWatch, files: AttemptFiles) -> None:
        """Forecast when a steady rise reaches the limit; when that comes before the checkpoint
        after next, restart right after the next one (asking for it when the limit is nearer)."""
        forecast = self.trend.add(sample, watch.last_step, self.config.memory_limit, self.config.soft_threshold)
        self.forecast_board.show(forecast)
        if forecast is None or forecast.move is Move.WATCH or not self.config.checkpoints:
            return  # without checkpoints a restart would redo everything: the forecast is only shown
        if self.trend.restart_reason is None:
            self.trend.restart_reason = f"planned restart after the next checkpoint: {forecast.text}"
            self._event("planned_restart", reason=self.trend.restart_reason, budget=forecast.budget,
                        seconds_to_limit=round(forecast.seconds_to_limit, 1), bytes_per_s=round(forecast.per_s),
                        limit=forecast.limit, move=forecast.move.value)
            log(self.trend.restart_reason)
        if forecast.move is Move.CHECKPOINT_NOW and not self.trend.asked:
            self.trend.asked = True
            watch.last_request = time.monotonic()
            self._ask_for_checkpoint(files, f"memory forecast: {forecast.text}")

    def _consider_growth(self, watch: AttemptWatch) -> None:
        """--grow: after a stable period, plan a larger micro-batch the model predicts fits; the
        restart waits for the next checkpoint so no work is lost."""
        stable = time.monotonic() - watch.running_since() >= self.config.grow_after
        if not (self.config.grow and self.config.checkpoints and stable) or watch.grow_to is not None:
            return
        current = self.plan.batch.micro_batch
        prediction = self.tuner.growth(current, self._peak(watch), self.last_sample)
        if prediction is not None:
            watch.grow_to = prediction.micro_batch
            self._event("grow_planned", micro_batch=prediction.micro_batch, from_micro_batch=current,
                        predicted_bytes=prediction.predicted_peak, why=prediction.reason)
            log(f"--grow: micro-batch {prediction.micro_batch} predicted to fit ({prediction.reason}); "
                "restarting at the next checkpoint")

    def _check_checkpoints(self, watch: AttemptWatch, worker_alive: bool = True) -> None:
        """Journal new checkpoints. While the worker runs only settled ones count; once it has
        exited nothing is being written, so the last ones it wrote count too."""
        bad = self.journal.bad_checkpoints()
        found = self.index.settled(bad) if worker_alive else [
            c for c in self.index.refresh(force=True) if c.path not in bad]
        for ckpt in found:
            step = ckpt.step if ckpt.step is not None else watch.step_at(ckpt.mtime)
            if self.journal.checkpoint_seen(ckpt.path, step, ckpt.mtime, self.attempt):
                watch.checkpoint_landed(step, time.monotonic(), time.time())
                self._event("checkpoint", path=ckpt.path, step=step)
                self.trend.checkpoint_seen(time.monotonic())
                if self.trend.restart_reason and worker_alive:
                    self._restart_now()
                if watch.grow_to is not None and not watch.growing and self.worker is not None:
                    watch.growing = True
                    self.worker.stop(self.config.grace_period)

    def _ask_for_checkpoint(self, files: AttemptFiles, why: str) -> None:
        """The request file is always written (scripts poll it); the signal only goes to a worker
        that handles it."""
        assert self.worker is not None
        write_atomic(files.checkpoint_request, f"{time.time()} {why}\n")
        sig = signal.Signals[self.config.checkpoint_signal]
        sent = self.worker.send_if_handled(sig)
        self._event("checkpoint_request", reason=why, signal=sig.name if sent else None)

    def _check_hang(self, watch: AttemptWatch) -> None:
        assert self.worker is not None
        now = time.monotonic()
        judgement = watch.check_hang(self.worker.last_output, self.config.hang_timeout, now)
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
        watch.hung = hung = judgement.hung
        self._event("hang", **judgement.figures)
        log(f"worker hung: {hung}; dumping its stack")
        self._guarded("stack dump", self.worker.dump_stack)
        self.worker.stop(min(self.config.grace_period, 10.0))

    # --- after an attempt ---------------------------------------------------------------------

    def _recover(self, verdict: Verdict, watch: AttemptWatch, checkpoint: Checkpoint | None) -> Decision:
        assert verdict.kind is not None
        self._transition(RunState.RECOVERING, f"attempt {self.attempt} ended: {verdict.kind.value}"
                         f" ({verdict.evidence})")
        load_error = checkpoint is not None and watch.scanner.load_error is not None and not watch.progressed
        scan = watch.scanner
        fragmentation = judge(scan.tried_bytes, scan.reserved_unallocated, scan.capacity_bytes,
                              self.tuner.predicted_gpu_peak(self.plan.batch.micro_batch, self.last_sample))
        if verdict.kind is FailureKind.CUDA_OOM and scan.tried_bytes is not None:
            self._event("fragmentation", fragmented=fragmentation.fragmented, why=fragmentation.why)
        failure = Failure(self.attempt, verdict.kind, self.plan.batch.micro_batch, verdict.evidence,
                          fragmentation.fragmented, watch.new_checkpoint,
                          checkpoint.path if checkpoint else None, load_error)
        attribution = self._attribute(verdict, watch)
        if attribution is not None:
            failure = replace(failure, attribution=attribution)
        fits = attribution is None or attribution.cause.fits_model  # leaks and phase spikes stay out of the fit
        if fits:
            self.tuner.record(failure.micro_batch, self._peak(watch), memory_failed=verdict.kind.is_memory)
        hint = (self.tuner.shrink_hint(failure.micro_batch, self.last_sample)
                if verdict.kind.is_memory and fits else None)
        if hint is not None:
            self._event("memory_model", micro_batch=hint.micro_batch, predicted_bytes=hint.predicted_peak,
                        why=hint.reason)
        decision = decide(failure, self.failures, self.plan, _policy_config(self.config),
                          fit_hint=hint.micro_batch if hint else None)
        decision = self.world.decision(self.attempt, decision)
        self.failures.append(failure)
        self.journal.end_attempt(self.attempt, returncode=self.worker.returncode if self.worker else None,
                                 exit_code=verdict.exit_code, signal=verdict.signal, kind=verdict.kind.value,
                                 evidence=verdict.evidence, decision=decision.reason,
                                 last_step=watch.last_step, peak_rss=watch.peak_rss)
        if decision.bad_checkpoint:
            self.journal.mark_bad(decision.bad_checkpoint, watch.scanner.load_error or "load failed")
            self._event("checkpoint_bad", path=decision.bad_checkpoint, evidence=watch.scanner.load_error)
        self._event("decision", action=decision.action.value, reason=decision.reason,
                    micro_batch=decision.plan.batch.micro_batch, grad_accum=decision.plan.batch.grad_accum,
                    kind=verdict.kind.value, evidence=verdict.evidence,
                    cause=attribution.cause.value if attribution else None)
        self.plan = decision.plan
        self._save_plan()
        return decision

    def _attribute(self, verdict: Verdict, watch: AttemptWatch) -> Attribution | None:
        """The cause of a memory failure, journaled with the figures that decided it."""
        if verdict.kind is None or not verdict.kind.is_memory:
            return None
        scan = watch.scanner
        attribution = self.trend.attribute(Evidence(tuple(scan.frames), tuple(scan.tail), scan.dataloader),
                                           self.plan.batch.micro_batch, fit(self.tuner.points))
        if attribution.cause is Cause.LEAK and (rate := attribution.figures.get("bytes_per_s")):
            self.trend.prior_per_s = float(rate)
        self._event("attribution", **attribution.as_dict())
        log(f"cause: {attribution.summary}")
        return attribution

    def close(self) -> None:
        self.journal.close()


def _policy_config(config: RunConfig) -> PolicyConfig:
    return PolicyConfig(config.min_micro_batch, config.max_restarts, config.backoff, config.max_backoff,
                        len(config.fallback_args))


def _failure_from_row(row: dict[str, Any]) -> Failure:
    return Failure(row["attempt"], FailureKind(row["kind"]), row["micro_batch"], row["evidence"] or "")
