"""What the run keeps from one attempt to the next, and what every loop tick does besides watching.

Tested in tests/e2e/test_outcome.py (bad checkpoints, resume points) and tests/e2e/test_supervisor.py.

The loop builds one ``RunParts`` and hands it to each attempt (``run/attempt.py``): the configuration,
the journal's recorder, the control flags, the observers (checkpoints, memory, wiring) and the actors
(spares, the handover between attempts, the other nodes), and the memory knowledge.

Also here:

- Which checkpoint an attempt resumes from: the newest valid one, with the step it holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide import policy as replan
from oomguard.supervisor.decide.attribution import Cause
from oomguard.supervisor.decide.classify import Addition, OwnFault
from oomguard.supervisor.decide.policy import Plan, PlanChange, PolicyConfig
from oomguard.supervisor.decide.recovery import Recovery, RecoveryConfig
from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.allocator import BreakdownWatch
from oomguard.supervisor.observe.checkpoints import Checkpoint, CheckpointIndex
from oomguard.supervisor.observe.progress import AttemptWatch
from oomguard.supervisor.observe.sampler import MemorySample, Sampler
from oomguard.supervisor.record.fitstore import FitStore, JobKey
from oomguard.supervisor.record.logs import say as log
from oomguard.supervisor.run.containment import Handover
from oomguard.supervisor.run.control import ControlFlags
from oomguard.supervisor.run.recorder import Recorder
from oomguard.supervisor.run.spare import Spares
from oomguard.supervisor.run.trendwatch import ForecastBoard, TrendWatch
from oomguard.supervisor.run.wiringwatch import WiringWatch
from oomguard.supervisor.run.world import World
from oomguard.supervisor.sizing.memmodel import Point, SizeTuner

TICK = 0.5  # seconds between checks while a worker runs; exits, signals and requests wake the loop at once
THIN_EVERY = 300.0  # seconds between downsampling passes over the journal's samples


# Which checkpoint an attempt resumes from: the newest valid one, with the step it holds.
#
# The index (``observe/checkpoints.py``) finds checkpoints; this adds what the journal knows of them:
# the ones marked bad (a load that failed), and the steps an earlier supervisor on this run
# directory saw them written at.

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


class Chores:
    """What every loop tick does besides watching the worker: the hooks' tickers, keeping the spares,
    publishing what is degraded (for ``oomguard status``), thinning the journal's samples now and then."""

    def __init__(self, tickers: list[Callable[[], object]]) -> None:
        self.tickers = tickers
        self._next_thin = time.monotonic() + THIN_EVERY
        self._published = 0

    def tick(self, parts: RunParts) -> None:
        record = parts.record
        for ticker in self.tickers:
            record.guarded("tickers", ticker)  # an ops hook must never stop supervision
        record.guarded("spare", parts.spares.tick)  # the reserve starts once the spare before it has imported
        if record.degradations.version != self._published:
            self._published = record.degradations.version
            record.meta(degraded=record.degradations.active())
        if time.monotonic() >= self._next_thin:
            self._next_thin = time.monotonic() + THIN_EVERY
            record.journal.thin_samples()


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
    chores: Chores
    last_sample: MemorySample | None = None
    probe_off: str | None = None  # why the probe is off since an attempt it failed (decide/ownfault.py)
    # what filled memory, per rank and attempt (observe/allocator.py; record/memoryparts.py words it)
    breakdowns: BreakdownWatch = field(default_factory=BreakdownWatch)

    @classmethod
    def build(cls, config: RunConfig, plan: Plan, cwd: Path, record: Recorder, control: ControlFlags,
              tickers: list[Callable[[], object]]) -> RunParts:
        run_dir, event, meta = config.run_dir.resolve(), record.event, record.meta
        tuner = SizeTuner(plan.batch.per_process_batch, config.batch.min_micro_batch,
                          margin=max(0.0, 1.0 - config.memory.soft_threshold), memory_limit=config.memory.memory_limit)
        spares = Spares(config.spare, run_dir, cwd, config.memory.memory_limit, event, say=lambda doc: meta(spare=doc))
        parts: RunParts
        wiring = WiringWatch(config, cwd, run_dir, log, event, meta,  # resumes, globs that miss
                             lambda: parts.last_sample.worker_pids if parts.last_sample else ())
        index = CheckpointIndex(config.checkpoints.globs, cwd)
        # the world: ranks and nodes; an elastic run's host takes a node back in after the next checkpoint
        world = World(config.dist_shape, config.distributed.peer_timeout, event, index, lambda: control.stopping)
        parts = cls(config, cwd, run_dir, record, control, ResumePoints(index, record, cwd), Sampler(), tuner, world,
                    Handover(event, log), spares, wiring, ForecastBoard(meta), Chores(tickers))
        return parts

    def tick(self) -> None:
        self.chores.tick(self)

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
        """The policy found the attempt died in oomguard's own code: the attempts after it run without
        that addition, as under --no-probe or --no-spare; said once, journaled once."""
        if own.addition is Addition.PROBE:
            self.config = replace(self.config, probe=False)  # build_env leaves the probe's PYTHONPATH out
            self.probe_off = own.off(attempt)
        else:
            self.spares.turn_off()
        self.record.event("own_failure", addition=own.addition.value, frame=own.frame, reason=own.reason,
                          off=own.off(attempt))
        log(own.reason)

    def learn(self, plan: Plan, fresh: bool) -> PlanChange | None:
        """Load what this run, and earlier runs of the same job, learned about memory; where a fresh
        run of a job measured before should start (the fit store's size)."""
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
        """Keep what a recovery learned: the memory knowledge (its new point in the fit store too, for
        the next run of this job) and a leak's rate (the next attempt's forecast starts from it)."""
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
