"""An attempt's memory while it runs: each sample journaled and judged against the thresholds, the
trend's forecast, and ``--grow``'s larger size; what they plan is the attempt's one ``Pending``.

A reading over the hard threshold or ``--memory-limit`` stops the worker now; a forecast whose limit
comes before the checkpoint after next plans a restart right after the next one (and asks for it
when the limit is nearer); a stable stretch under ``--grow`` plans a larger micro-batch the model
predicts fits, restarted at the next checkpoint so no work is lost.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from oomguard.supervisor.lifecycle.outcome import Pending
from oomguard.supervisor.lifecycle.states import StopReason
from oomguard.supervisor.observe.sampler import MemoryAction, MemorySample, Thresholds, evaluate
from oomguard.supervisor.record.console import say as log
from oomguard.supervisor.sizing.trend import Move

if TYPE_CHECKING:
    from oomguard.supervisor.run.attempt import Attempt


def sample(attempt: Attempt) -> None:
    """One memory sample: journal it, fold the attempt's peak, act on the thresholds."""
    worker, watch, parts = attempt.worker, attempt.watch, attempt.parts
    assert worker is not None
    config, record = parts.config, parts.record
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
    verdict = evaluate(reading, Thresholds(config.soft_threshold, config.psi_threshold, config.memory_limit), pending)
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
    """Forecast when a steady rise reaches the limit; when that comes before the checkpoint
    after next, restart right after the next one (asking for it when the limit is nearer)."""
    trend, parts, config = attempt.trend, attempt.parts, attempt.parts.config
    forecast = trend.add(reading, attempt.watch.last_step, config.memory_limit, config.soft_threshold,
                         attempt.watch.allocator.reading())
    parts.board.show(forecast)
    if forecast is None or forecast.move is Move.WATCH or not config.checkpoints:
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
    """--grow: after a stable period, plan a larger micro-batch the model predicts fits; the
    restart waits for the next checkpoint so no work is lost."""
    parts, config, watch = attempt.parts, attempt.parts.config, attempt.watch
    stable = time.monotonic() - watch.running_since() >= config.grow_after
    if not (config.grow and config.checkpoints and stable) or attempt.pending is not None:
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
