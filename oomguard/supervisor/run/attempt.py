"""One attempt: start its worker, watch it to its end, stop it when it must stop, and say how it ended.

Tested in tests/unit/supervisor/run/test_attempt.py (the trend's judgements), tests/e2e/test_outcome.py,
tests/e2e/test_memory.py and tests/e2e/test_supervisor.py.

``Attempt.watch_to_end`` returns one ``Outcome`` (``lifecycle.py``) for the loop to dispatch on.
Every stop goes through ``Attempt.stop(reason)``, whose first reason is the attempt's. A memory
reading over the hard threshold or ``--memory-limit`` stops the worker now; a forecast whose limit
comes before the checkpoint after next, or a stable stretch under ``--grow``, is the attempt's one
``Pending``: a restart right after the next checkpoint, so no work is lost.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from oomguard.common import protocol
from oomguard.supervisor.command import Edit, apply_edits, not_python
from oomguard.supervisor.decide.attribution import (
    Attribution,
    Cause,
    Evidence,
    Limit,
    Plateau,
    attribute,
    earlier_plateaus,
    step_peaks,
)
from oomguard.supervisor.decide.classify import Addition, FailureKind
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.decide.recovery import Facts, Readings
from oomguard.supervisor.lifecycle import Outcome, Pending, Stop, StopReason, ending_of, grace
from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.allocator import ProbeReport
from oomguard.supervisor.observe.checkpoints import Checkpoint, StepEvidence
from oomguard.supervisor.observe.progress import AttemptWatch, ChannelReader, StepMatcher
from oomguard.supervisor.observe.sampler import MemoryAction, MemorySample, evaluate
from oomguard.supervisor.record.fitstore import ModelPrint
from oomguard.supervisor.record.journal import write_atomic
from oomguard.supervisor.record.logs import say as log
from oomguard.supervisor.record.memoryparts import memory_breakdown
from oomguard.supervisor.run.containment import Containment
from oomguard.supervisor.run.process import (
    OWN_CODE,
    AttemptFiles,
    WorkerProcess,
    build_argv,
    build_env,
    placeholder_values,
)
from oomguard.supervisor.run.runparts import TICK, RunParts
from oomguard.supervisor.sizing.memmodel import Fit
from oomguard.supervisor.sizing.trend import ALLOCATOR, Forecast, Move, Reading, budgets, forecast, soonest, steady_rise

MAX_READINGS = 600  # per budget; past this, every other reading is dropped (the whole attempt stays in view)
HOST = "worker RSS"
MACHINE = "host"  # the machine's memory in use against its total: what a kernel OOM kill without a cgroup limit hit
# Which limit a failure of each kind hit, first choice first: the allocator's (the probe's step peaks),
# the GPU's (a CUDA OOM's own per-process capacity before NVML's figure), oomguard's own
# --memory-limit (a cgroup limit where one is made, so the cgroup's next), the cgroup's, the machine's.
LIMIT_OF: dict[FailureKind | None, tuple[str, ...]] = {
    FailureKind.CUDA_OOM: (ALLOCATOR, "GPU"),
    FailureKind.MEMORY_LIMIT: ("--memory-limit", "cgroup"),
    FailureKind.HOST_OOM: ("cgroup", MACHINE),
}


@dataclass
class TrendWatch:
    """The attempt's memory trend: its readings per budget, its checkpoint rhythm, the newest forecast,
    and whether a checkpoint was asked for because of it (a forecast is acted on once per attempt).
    The judgements are pure (``sizing/trend.py``, ``decide/attribution.py``); this keeps their inputs."""

    prior_per_s: float | None = None  # a leak rate measured earlier in this run
    prior_period: float | None = None  # the checkpoint period seen in earlier attempts
    started: float = 0.0  # monotonic start of the attempt
    series: dict[str, list[Reading]] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)  # each budget's limit itself (not the target), newest
    checkpoint_times: list[float] = field(default_factory=list)  # monotonic, new checkpoints of this attempt
    forecast: Forecast | None = None
    asked: bool = False  # a checkpoint was asked for because of the forecast

    def add(self, sample: MemorySample, step: int | None, memory_limit: int | None,
            fraction: float, allocator: tuple[int, int] | None = None) -> Forecast | None:
        """Fold one sample in; the forecast for the budget whose limit comes first (``allocator``: the probe's)."""
        t = sample.monotonic
        if sample.worker_rss_bytes is not None:
            self._keep(HOST, Reading(t, sample.worker_rss_bytes, step))
        if sample.gpus:
            self._keep("GPU memory", Reading(t, sample.worker_gpu_bytes or 0, step))
        found = budgets(sample, memory_limit, fraction, allocator)
        for budget in found:
            self._keep(budget.name, Reading(t, budget.used, step))
            self.limits[budget.name] = budget.applies
        self._keep(MACHINE, Reading(t, sample.host_total_bytes - sample.host_available_bytes, step))
        self.limits[MACHINE] = sample.host_total_bytes
        next_in, period = self.checkpoint_rhythm(t)
        found_forecast = soonest([forecast(self.series[b.name], b, next_in, period, self.prior_per_s)
                                  for b in found])
        if found_forecast is not None and found_forecast.measured and found_forecast.move is not Move.WATCH \
                and not self.leaking():
            # A cgroup's working set also grows with page cache the kernel reclaims before any OOM
            # kill (a dataset read once): act only when the worker's own memory rises too.
            found_forecast = replace(found_forecast, move=Move.WATCH)
        self.forecast = found_forecast
        return self.forecast

    def _keep(self, name: str, reading: Reading) -> None:
        readings = self.series.setdefault(name, [])
        readings.append(reading)
        if len(readings) > MAX_READINGS:
            self.series[name] = readings[::2]

    def checkpoint_seen(self, now: float) -> None:
        self.checkpoint_times.append(now)

    def checkpoint_rhythm(self, now: float) -> tuple[float | None, float | None]:
        """(seconds to the next checkpoint, period), from this attempt's checkpoints, else earlier ones'."""
        times = self.checkpoint_times
        if len(times) >= 2:
            recent = times[-6:]
            period: float | None = statistics.median([b - a for a, b in zip(recent, recent[1:], strict=False)])
        else:
            period = self.prior_period
        if period is None:
            return None, None
        anchor = times[-1] if times else self.started
        return max(0.0, anchor + period - now), period

    def attribute(self, evidence: Evidence, micro_batch: int, model: Fit | None = None,
                  kind: FailureKind | None = None, failed_at: float | None = None,
                  earlier: Sequence[Plateau] = ()) -> Attribution:
        """The cause of this attempt's memory failure (``_own``'s series) against the limit a failure of
        ``kind`` hit; without a kind (a planned restart) the readings are no lower bounds."""
        seen = self.readings(kind, failed_at, evidence)
        return attribute(list(seen.series), evidence, micro_batch, seen.name, model, seen.limit, earlier,
                         failed=kind is not None)

    def planned_restart(self, micro_batch: int) -> Attribution | None:
        """At a planned restart: the leak the readings show, if any; its rate is kept for the next forecast."""
        per_s = self.forecast.per_s if self.forecast else self.prior_per_s
        attribution = self.attribute(Evidence(), micro_batch)
        self.prior_per_s = per_s
        return attribution if attribution.cause is Cause.LEAK else None

    def readings(self, kind: FailureKind | None, failed_at: float | None, evidence: Evidence) -> Readings:
        """The series a failure's cause is judged on and the limit it hit (``attribute``'s inputs)."""
        name = self._own()
        # Under RLIMIT_AS the probe names the limit the failure met; the cgroup's or the host's did not apply.
        limit = None if evidence.address_space is not None else self.limit(kind, failed_at, evidence.capacity)
        return Readings(name, tuple(self.series.get(name, [])), limit)

    def limit(self, kind: FailureKind | None, failed_at: float | None = None,
              capacity: int | None = None) -> Limit | None:
        """The limit a failure of ``kind`` hit, with its readings: the allocator's where the probe reports
        step peaks; a CUDA OOM's own per-process ``capacity`` (NVML cannot see it); else LIMIT_OF's."""
        for budget in LIMIT_OF.get(kind, ()):
            if budget == "GPU" and capacity and self.series.get("GPU memory"):
                return Limit("process's GPU", capacity, self.series["GPU memory"], failed_at)
            if self.series.get(budget) and self.limits.get(budget):
                return Limit(budget, self.limits[budget], self.series[budget], failed_at)
        return None

    def leaking(self) -> bool:
        """Did memory rise steadily in this attempt (its peak is not a per-sample figure)?"""
        trend = steady_rise(self.series.get(self._own(), []))
        return trend is not None and trend.steady()

    def _own(self) -> str:
        """The worker's own memory: the probe's step peaks, else NVML's GPU memory, else its RSS."""
        return next((name for name in (ALLOCATOR, "GPU memory") if self.series.get(name)), HOST)


def render(parts: RunParts, plan: Plan, number: int, checkpoint: Checkpoint | None, files: AttemptFiles,
           edits: list[Edit]) -> tuple[list[str], dict[str, str]]:
    """An attempt's argv and environment for ``plan``."""
    config = parts.config
    values = placeholder_values(config, plan, number, checkpoint)
    argv = build_argv(config, plan, values)
    if edits:  # --edit: this attempt's copies of the config files, and the argv pointed at them
        argv = apply_edits(edits, argv, values, parts.cwd, parts.run_dir / "edits" / f"attempt-{number}")
    env = build_env(config, plan, values, files)
    return parts.world.command(argv, env, files, number), env


class Attempt:
    """One attempt of the run: its worker, what is learned while it runs, and how it was stopped."""

    def __init__(self, parts: RunParts, number: int, plan: Plan, checkpoint: Checkpoint | None,
                 files: AttemptFiles, previous: TrendWatch) -> None:
        self.parts, self.number, self.plan, self.checkpoint, self.files = parts, number, plan, checkpoint, files
        config = parts.config
        self.watch = AttemptWatch(matcher=StepMatcher(config.liveness.progress_pattern or None, plan.batch.grad_accum),
                                  probe=ProbeReport.for_command(config.probe, not_python(config.command),
                                                                parts.probe_off))
        self.trend = TrendWatch(previous.prior_per_s, previous.checkpoint_rhythm(0.0)[1], time.monotonic())
        self.worker: WorkerProcess | None = None
        self.stopped: Stop | None = None  # the one reason oomguard stopped it (None while it runs on its own)
        self.pending: Pending | None = None  # a restart planned for right after the next checkpoint
        self.additions: frozenset[Addition] = frozenset()  # oomguard's own code in the worker
        self.handover_lost: str | None = None  # the spare it was handed to had exited already: why
        self._containment: Containment | None = None

    # --- start -------------------------------------------------------------------------------

    def start(self, argv: list[str], env: dict[str, str], echo: Callable[[bytes], None]) -> None:
        """Start the worker and open the attempt's row in the journal."""
        record = self.parts.record
        record.meta(probe=self.watch.probe.as_meta())
        self.parts.wiring.attempt_started(self.number, self.checkpoint, self.watch)
        self._start_worker(argv, env, echo)
        assert self.worker is not None
        record.attempt_started(self.worker.pgid, self.plan, self.checkpoint, argv, self.files.log)

    def _start_worker(self, argv: list[str], env: dict[str, str], echo: Callable[[bytes], None]) -> None:
        """Start the worker (a spare's, when one is taken) in a fresh cgroup; then a spare for the next."""
        parts, config = self.parts, self.parts.config
        spare = parts.spares.take(argv, env, lambda: parts.control.stopping)
        containment = self._containment = parts.handover.next_containment(
            f"oomguard-{os.getpid()}-worker", config.memory.memory_limit, parts.sampler.gpu,
            config.memory.settle_timeout, spare.containment if spare else None)
        if containment.cgroup is None and self.number == 1:
            log(f"no memory cgroup ({containment.why_none}); --memory-limit is enforced by watching RSS")
        self.files.checkpoint_request.unlink(missing_ok=True)
        self.worker = WorkerProcess(argv, env, parts.cwd, self.files.log, parts.world.line_sink(self.watch.feed_line),
                                    echo, containment.procs, log_max_bytes=config.log_max_bytes,
                                    problems=parts.record.degradations)
        self.additions = frozenset({Addition.PROBE} if config.probe else set()) | (
            {Addition.SPARE} if spare else set())
        self.worker.start(parts.control.wake, spare.hand_over() if spare else None)
        self.handover_lost = spare.lost if spare else None
        parts.sampler.cgroup = containment.cgroup  # the sampler reads the worker's own
        parts.record.meta(worker_pid=None, rank_pids={})  # named at the first sample (run/process.py)
        parts.record.guarded("spare", parts.spares.prepare, argv, env)

    # --- watch -------------------------------------------------------------------------------

    def watch_to_end(self) -> Outcome:
        """Watch the worker until it exits, and return how the attempt ended."""
        worker, watch, parts = self.worker, self.watch, self.parts
        assert worker is not None and self._containment is not None
        channel = ChannelReader(self.files.events)
        self._watch(channel)
        guarded = parts.record.guarded
        guarded("channel", self._read_channel, channel)
        guarded("wiring", parts.wiring.tick, watch, parts.resume.index)
        parts.board.clear()
        guarded("checkpoints", self.check_checkpoints, False)  # its last ones may carry its last step
        if watch.progress is not None:
            parts.record.meta(progress={**watch.progress, "attempt": self.number})
        worker.reap()
        assert worker.returncode is not None
        facts = self._containment.exit_facts(worker.returncode, watch, self.stopped)
        gpus = bool(parts.last_sample and parts.last_sample.gpus)
        verdict = parts.world.verdict(facts, watch.scanner, gpus)
        self.stopped = parts.world.stop(self.stopped)  # a node lost or back: a planned restart on every node
        ending = ending_of(self.stopped, verdict, parts.control.stopping)
        kind = verdict.kind.value if verdict.kind is not None and ending.is_failure else None
        guarded("memory breakdown", memory_breakdown, parts.breakdowns, kind, self.number,
                self.plan.batch.micro_batch, parts.record.event, parts.config.batch.fallback_args, log)
        return Outcome(ending, verdict, self.stopped, watch, self.checkpoint, worker.returncode,
                       worker.exited_at, self.additions, self.handover_lost)

    def _watch(self, channel: ChannelReader) -> None:
        """Every tick until the worker exits: every stop it needs goes through ``stop``."""
        worker, parts, control = self.worker, self.parts, self.parts.control
        assert worker is not None
        guarded, next_sample = parts.record.guarded, 0.0
        while not worker.exited.is_set():
            control.sleep(TICK)
            parts.tick()
            if control.stopping:
                sig = signal.Signals(control.stop_signal or signal.SIGTERM).name
                # A later supervisor closing it knows it was the user's.
                parts.record.event("stop_requested", signal=sig)
                self.stop(StopReason.USER, f"stopped by {sig}")
                break
            if control.take("restart"):
                self.stop(StopReason.RESTART, "restart requested")
                break
            guarded("channel", self._read_channel, channel)
            if time.monotonic() >= next_sample:
                next_sample = time.monotonic() + parts.config.memory.sample_interval
                guarded("sampling", sample, self)
                guarded("checkpoints", self.check_checkpoints)
            if control.take("checkpoint"):
                guarded("checkpoint request", self.ask_for_checkpoint, "requested")
            self._check_hang()
            self._check_peers()
            guarded("wiring", parts.wiring.tick, self.watch, parts.resume.index)

    # --- stop --------------------------------------------------------------------------------

    def stop(self, reason: StopReason, detail: str, grow_to: int | None = None,
             first: Callable[[], object] | None = None) -> None:
        """The one way oomguard stops a worker: the first reason is the attempt's, the grace the reason's
        (``lifecycle.grace``); ``first`` runs before the SIGTERM (a hang's stack dump)."""
        worker, parts = self.worker, self.parts
        if worker is None or worker.exited.is_set():
            return
        if self.stopped is None:
            self.stopped = Stop(reason, detail, grow_to)
            parts.record.event("worker_stop", reason=reason.value, detail=detail)
        if first is not None:
            parts.record.guarded("stack dump", first)
        worker.stop(grace(reason, parts.config.liveness.grace_period), lambda: parts.control.forced)

    def plan_restart(self, pending: Pending) -> bool:
        """Restart right after the next checkpoint; one at a time: the forecast's replaces a planned grow
        (memory is rising), a grow waits while a restart is planned. False when not planned."""
        if self.pending is not None and not (pending.reason is StopReason.PLANNED
                                             and self.pending.reason is not StopReason.PLANNED):
            return False
        self.pending = pending
        return True

    def _checkpoint_landed(self, path: str | None) -> None:
        """Carry out the planned restart right after a checkpoint."""
        if (pending := self.pending) is not None:
            self.stop(pending.reason, pending.stop(path).detail, pending.grow_to)

    # --- what the worker says ---------------------------------------------------------------

    def _read_channel(self, channel: ChannelReader) -> None:
        record = self.parts.record
        for item in channel.read():
            record.guarded("memory breakdown", self.parts.breakdowns.take, item, self.number)
            if self.watch.take(item, time.monotonic()):
                record.event(f"worker_{item['type']}", **{k: v for k, v in item.items() if k != "type"})
            if item["type"] == "probe":
                record.meta(probe=self.watch.probe.as_meta())
            if item["type"] == "checkpoint" and self.pending is not None and self.pending.on_save_record:
                self._checkpoint_landed(None)  # the worker says it saved: sooner than the file settling
            if item["type"] == protocol.MODEL and (model := ModelPrint.from_record(item)) is not None:
                self._model_seen(model)

    def _model_seen(self, model: ModelPrint) -> None:
        """The probe's model against the fit store's record: another model is said and journaled once; where
        the record made this run start small, one node restarts at the size asked for (the --grow path)."""
        parts = self.parts
        change = parts.tuner.model_seen(model, self.plan.batch.micro_batch)
        if change is None:
            return
        # A record read after the worker exited, or while it is being stopped for another reason: no restart.
        running = self.worker is not None and not self.worker.exited.is_set() and self.stopped is None
        restart_at = change.restart_at if parts.world.nodes is None and running else None
        parts.record.event("model_changed", params=change.now.params, measured_params=change.then.params,
                           digest=change.now.digest, measured_digest=change.then.digest, restart_at=restart_at)
        log(replace(change, restart_at=restart_at).text)
        if restart_at is not None:
            self.stop(StopReason.MODEL, f"model changed: micro-batch {restart_at}, the size asked for",
                      grow_to=restart_at)

    # --- checkpoints -------------------------------------------------------------------------

    def check_checkpoints(self, worker_alive: bool = True) -> None:
        """Journal new checkpoints: settled ones while it runs, the last it wrote too once it has exited."""
        parts, watch = self.parts, self.watch
        index, bad = parts.resume.index, parts.resume.bad()
        found = index.settled(bad) if worker_alive else [c for c in index.refresh(force=True) if c.path not in bad]
        for ckpt in found:
            evidence = self._checkpoint_step(ckpt)
            step = evidence.step
            if parts.record.journal.checkpoint_seen(ckpt.path, step, ckpt.mtime, self.number):
                watch.checkpoint_landed(step, time.monotonic(), time.time())
                parts.record.event("checkpoint", path=ckpt.path, step=step, step_from=evidence.source)
                self.trend.checkpoint_seen(time.monotonic())
                if worker_alive:
                    self._checkpoint_landed(ckpt.path)

    def _checkpoint_step(self, ckpt: Checkpoint) -> StepEvidence:
        """The step ``ckpt`` holds, from the best evidence, taught to the index for choosing a resume point."""
        if ckpt.step_from == ckptstep.SAVE:  # learned from this write's save record already
            return StepEvidence(ckpt.step, ckpt.step_from)
        watch = self.watch
        saved = watch.saved_step(ckpt.path, ckpt.mtime, os.path.isdir(ckpt.path))
        by_time = watch.step_at(ckpt.mtime) if saved is None and ckpt.step is None else None
        evidence = ckptstep.resolve(saved, StepEvidence(ckpt.step, ckpt.step_from), by_time)
        self.parts.resume.index.learn(ckpt, evidence)
        return evidence

    def ask_for_checkpoint(self, why: str) -> None:
        """The request file is always written (scripts poll it); the signal only to a worker that handles it."""
        assert self.worker is not None
        write_atomic(self.files.checkpoint_request, f"{time.time()} {why}\n")
        sig = signal.Signals[self.parts.config.checkpoints.signal]
        sent = self.worker.send_if_handled(sig)
        self.parts.record.event("checkpoint_request", reason=why, signal=sig.name if sent else None)

    # --- hangs and peers ---------------------------------------------------------------------

    def _check_hang(self) -> None:
        worker, watch, record = self.worker, self.watch, self.parts.record
        assert worker is not None
        if self.stopped is not None:
            return  # already being stopped: a worker on its way out is quiet
        now = time.monotonic()
        judgement = watch.check_hang(worker.last_output, self.parts.config.liveness.hang_timeout, now)
        if judgement is None:
            return
        news = watch.liveness.news(judgement, now)
        if news is not None:  # silent but busy, or no longer: status, the dashboard and the journal say why
            record.meta(liveness=judgement.note(self.number, time.time()))
            if news == "held":
                record.event("held_alive", **judgement.figures)
                log(f"worker {judgement.held}: not a hang")
        if judgement.hung is None:
            return
        record.event("hang", **judgement.figures)
        log(f"worker hung: {judgement.hung}; dumping its stack")
        self.stop(StopReason.HANG, judgement.hung, first=worker.dump_stack)

    def _check_peers(self) -> None:
        """Another node failed (ours would only wait in a collective), or the nodes regroup (elastic)."""
        stop = self.parts.world.news()
        if stop is not None:
            log(f"{stop.detail}; stopping this node's ranks")
            self.stop(stop.reason, stop.detail)

    # --- after it ended ----------------------------------------------------------------------

    def facts(self, outcome: Outcome) -> Facts:
        """What the recovery judges (``decide/recovery.py``), with what it needs from the journal."""
        verdict, watch, parts = outcome.verdict, outcome.watch, self.parts
        evidence = readings = None
        earlier: tuple = ()
        if verdict.kind is not None and verdict.kind.is_memory:
            evidence = self._evidence(outcome)
            readings = self.trend.readings(verdict.kind, outcome.exited_at, evidence)
            journal = parts.record.journal
            earlier = tuple(earlier_plateaus(journal.event_data("attribution"), journal.attempts()))
        checkpoint = outcome.checkpoint.path if outcome.checkpoint else None
        return Facts(self.number, verdict, watch, checkpoint, outcome.additions, outcome.handover_lost, OWN_CODE,
                     parts.last_sample, evidence, readings, earlier)

    def _evidence(self, outcome: Outcome) -> Evidence:
        """A memory failure's evidence beside its readings: its output, the probe's figures, the step peaks."""
        verdict, watch = outcome.verdict, outcome.watch
        scan, alloc = watch.scanner, watch.allocator.oom if verdict.kind is FailureKind.CUDA_OOM else None
        capacity = scan.allowed_bytes or (alloc.limit if alloc is not None and alloc.fraction else None)
        progress = watch.allocator.progress
        # The probe saw an allocation fail against the address-space limit, and the worker died of that
        # error (not of a kernel kill after an RLIMIT_AS error the script caught).
        rlimit = progress if verdict.kind is FailureKind.HOST_OOM and verdict.signal is None \
            and progress is not None and progress.memory == "address_space" else None
        return Evidence(tuple(scan.frames), tuple(scan.tail), scan.dataloader, capacity, alloc,
                        step_peaks(self.parts.record.journal.attempts()), rlimit)


# --- its memory while it runs ---------------------------------------------------------------------


def sample(attempt: Attempt) -> None:
    """One memory sample: journal it, fold the attempt's peak, act on the thresholds."""
    worker, watch, parts = attempt.worker, attempt.watch, attempt.parts
    assert worker is not None
    record = parts.record
    reading = parts.sampler.sample(worker.worker_pid or worker.pgid)
    parts.handover.procs.add(worker.tree())
    if (named := worker.named_pids()) is not None:  # the training process and ranks, for status
        record.meta(**named)
    parts.last_sample = reading
    record.guarded("memory breakdown", parts.breakdowns.sampled, reading, attempt.number)  # a kernel kill's last word
    watch.observe(reading)  # its peaks, and what its processes did since the last sample
    worker_bytes = reading.cgroup.working_set_bytes if reading.cgroup else reading.worker_rss_bytes
    if worker_bytes is not None:  # the spares' budget: their room is what the worker's peak leaves
        parts.spares.observe(worker_bytes, watch.last_step is not None, reading.worker_pids)
    record.sample(reading, watch.last_step, watch.progress)
    watch.progress = None
    pending = watch.request_pending(attempt.files.checkpoint_request.exists(), time.monotonic())
    verdict = evaluate(reading, parts.config.memory.thresholds, pending)
    if verdict.action is MemoryAction.STOP and attempt.stopped is None:
        why = verdict.evidence or verdict.reason
        log(f"stopping the worker: {why}")
        attempt.stop(StopReason.MEMORY, why)
    elif verdict.action is MemoryAction.CHECKPOINT:
        watch.last_request = time.monotonic()
        attempt.ask_for_checkpoint(f"{verdict.reason} ({verdict.evidence})")
    _foresee(reading, attempt)
    _consider_growth(attempt)


def _foresee(reading: MemorySample, attempt: Attempt) -> None:
    """Forecast a steady rise; a limit before the checkpoint after next plans a restart after the next."""
    trend, parts, config = attempt.trend, attempt.parts, attempt.parts.config
    forecast = trend.add(reading, attempt.watch.last_step, config.memory.memory_limit, config.memory.soft_threshold,
                         attempt.watch.allocator.reading())
    parts.board.show(forecast)
    if forecast is None or forecast.move is Move.WATCH or not config.checkpoints.globs:
        return  # without checkpoints a restart would redo everything: the forecast is only shown
    reason = f"planned restart after the next checkpoint: {forecast.text}"
    if attempt.plan_restart(Pending(StopReason.PLANNED, reason)):
        parts.record.event("planned_restart", reason=reason, budget=forecast.budget,
                           seconds_to_limit=round(forecast.seconds_to_limit, 1), bytes_per_s=round(forecast.per_s),
                           limit=forecast.limit, move=forecast.move.value)
        log(reason)
    if forecast.move is Move.CHECKPOINT_NOW and not trend.asked:
        trend.asked = True
        attempt.watch.last_request = time.monotonic()
        attempt.ask_for_checkpoint(f"memory forecast: {forecast.text}")


def _consider_growth(attempt: Attempt) -> None:
    """--grow: after a stable period, a larger micro-batch the model predicts fits, at the next checkpoint."""
    parts, config, watch = attempt.parts, attempt.parts.config, attempt.watch
    stable = time.monotonic() - watch.running_since() >= config.batch.grow_after
    if not (config.batch.grow and config.checkpoints.globs and stable) or attempt.pending is not None:
        return
    micro = attempt.plan.batch.micro_batch
    prediction = parts.tuner.growth(micro, parts.tuner.peak_bytes(watch.peak, parts.last_sample, watch.allocator),
                                    parts.last_sample)
    if prediction is None:
        return
    attempt.plan_restart(Pending(StopReason.GROW, f"--grow: micro-batch {prediction.micro_batch}",
                                 prediction.micro_batch))
    parts.record.event("grow_planned", micro_batch=prediction.micro_batch, from_micro_batch=micro,
                       predicted_bytes=prediction.predicted_peak, why=prediction.reason)
    log(f"--grow: micro-batch {prediction.micro_batch} predicted to fit ({prediction.reason}); "
        "restarting at the next checkpoint")
