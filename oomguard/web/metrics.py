"""``/metrics``: the run's figures in Prometheus text format, all named ``oomguard_*``.

Tested in tests/unit/supervisor/observe/test_sampler.py and tests/e2e/web/test_grafana.py.

A custom collector reads the journal at scrape time (in the scraping request's thread, through its
own read-only connection), so the supervision loop does no metrics work at all.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from oomguard.supervisor.lifecycle import RunState
from oomguard.supervisor.record import memoryparts
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.status import status_document
from oomguard.web.journals import chart_point

FRESH_S = 30.0


class RunCollector(Collector):
    def __init__(self, journal: Callable[[], Journal]) -> None:
        self._journal = journal

    def collect(self) -> Iterator[Metric]:
        journal = self._journal()
        doc = status_document(journal)
        yield from _state(doc["state"], doc["supervisor_alive"])
        for name, key, help_text in (
            ("attempt", "attempt", "number of the current (or last) attempt"),
            ("micro_batch", "micro_batch", "micro-batch per process"),
            ("grad_accum", "grad_accum", "gradient accumulation steps"),
            ("global_batch", "global_batch", "global (effective) batch the script trains at"),
            ("asked_global_batch", "asked_global_batch", "global batch asked for (above oomguard_global_batch once "
             "a script without accumulation was shrunk)"),
            ("world_size", "world_size", "data-parallel processes"),
        ):
            if isinstance(doc.get(key), int):
                yield GaugeMetricFamily(f"oomguard_{name}", help_text, value=doc[key])
        yield _restarts(doc["failures"])
        yield from _memory(journal)
        yield from breakdown_metrics(doc.get("memory_breakdown") or [], journal)
        yield from _progress(doc)


def _state(state: str, alive: bool) -> Iterator[Metric]:
    gauge = GaugeMetricFamily("oomguard_state", "1 for the run's current state", labels=["state"])
    for s in RunState:
        gauge.add_metric([s.value], 1.0 if s.value == state else 0.0)
    yield gauge
    yield GaugeMetricFamily("oomguard_supervisor_up", "1 while the supervisor process runs",
                            value=1.0 if alive else 0.0)


def _restarts(failures: list[dict[str, object]]) -> Metric:
    counter = CounterMetricFamily("oomguard_restarts", "failed attempts by failure kind", labels=["kind"])
    for kind, count in sorted(Counter(str(f["kind"]) for f in failures).items()):
        counter.add_metric([kind], count)
    return counter


def _memory(journal: Journal) -> Iterator[Metric]:
    # Only recent samples: older figures would describe a worker that is gone.
    latest = journal.samples(start=time.time() - FRESH_S, end=None, max_points=100_000)[-1:]
    if not latest:
        return
    point = chart_point(latest[0])
    if point["host_rss"] is not None:
        yield GaugeMetricFamily("oomguard_worker_rss_bytes", "RSS of the worker's process tree",
                                value=point["host_rss"])
    gpu = GaugeMetricFamily("oomguard_gpu_memory_used_bytes", "GPU memory used per device",
                            labels=["device"])
    for device, used in sorted(point["gpu"].items()):
        gpu.add_metric([device], used)
    yield gpu
    yield _rank_memory(latest[0])


def _rank_memory(row: dict[str, object]) -> Metric:
    """Each rank's memory on each GPU (torchrun runs), from the sample's per-device list."""
    ranks = GaugeMetricFamily("oomguard_gpu_rank_memory_bytes", "GPU memory of each rank's process per device",
                              labels=["device", "rank"])
    devices = row.get("gpus")
    for dev in devices if isinstance(devices, list) else []:
        for rank, used in sorted((dev.get("ranks") or {}).items()) if isinstance(dev, dict) else []:
            if isinstance(used, int):
                ranks.add_metric([str(dev.get("cuda_index")), str(rank)], used)
    return ranks


def _progress(doc: dict[str, object]) -> Iterator[Metric]:
    newest = doc.get("newest_checkpoint")
    if isinstance(newest, dict) and isinstance(newest.get("step"), int):
        yield GaugeMetricFamily("oomguard_checkpoint_step", "step of the newest good checkpoint",
                                value=newest["step"])
    progress = doc.get("progress")
    if isinstance(progress, dict):
        if isinstance(progress.get("step"), int):
            yield GaugeMetricFamily("oomguard_step", "last step the worker reported", value=progress["step"])
        rate = progress.get("samples_per_s")
        if isinstance(rate, int | float):
            yield GaugeMetricFamily("oomguard_samples_per_second", "training throughput the worker reported",
                                    value=float(rate))
        # From the in-process probe: real optimizer steps, the allocator's peak and its limit.
        for key, name, text in (("steps_per_s", "oomguard_steps_per_second", "optimizer steps per second (probe)"),
                                ("allocated_peak", "oomguard_allocated_peak_bytes",
                                 "the allocator's highest step peak in this attempt (probe)"),
                                ("limit_bytes", "oomguard_allocator_limit_bytes",
                                 "what the allocator may hold: a memory fraction's cap, else the device (probe)")):
            value = progress.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(name, text, value=float(value))


def breakdown_metrics(shown: list[dict[str, object]], journal: Journal) -> Iterator[Metric]:
    """What filled memory in the newest attempt with a breakdown, per rank and part
    (``record/memoryparts.py``); a part that was not seen has no sample, never a 0."""
    if not shown:  # status found none: no query of every event on each scrape
        return
    ranks = memoryparts.newest_attempt(memoryparts.from_events(journal.events_of(memoryparts.EVENT)))
    if not ranks:
        return
    parts = GaugeMetricFamily("oomguard_memory_breakdown_bytes", "what filled memory in the newest attempt "
                              "with a breakdown, per part and rank (at its OOM, its last reading, or the peak "
                              "of an attempt that fit)", labels=["part", "rank", "at"])
    limits = GaugeMetricFamily("oomguard_memory_breakdown_limit_bytes", "the limit that applied to that "
                               "breakdown, per rank", labels=["rank", "kind"])
    roles = GaugeMetricFamily("oomguard_memory_breakdown_process_bytes", "the last reading before a host or "
                              "kernel OOM, per kind of process of the worker's tree", labels=["role", "rank"])
    for b in ranks:
        rank = "" if b.rank is None else str(b.rank)
        for part in b.parts:
            if part.bytes is not None:
                parts.add_metric([part.key, rank, b.at], part.bytes)
        if b.limit is not None:
            limits.add_metric([rank, b.limit_kind or ""], b.limit)
        for role, rss in memoryparts.by_role(b.processes or ()).items():
            roles.add_metric([role, rank], rss)
    yield from (parts, limits, roles)
    yield GaugeMetricFamily("oomguard_memory_breakdown_attempt", "the attempt the breakdown gauges describe",
                            value=ranks[0].attempt)


def make_registry(journal: Callable[[], Journal]) -> CollectorRegistry:
    """A registry of its own per app (never the global one), so several apps can live in one process."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(journal))
    return registry
