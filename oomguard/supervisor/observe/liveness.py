"""Is a silent worker hung, or busy? Liveness from what the process does, not only from what it says.

A worker counts as hung only when, for the hang timeout, it printed nothing (no new step, where steps
are known), wrote no checkpoint, **and** its process tree used almost no CPU, moved almost no I/O,
**and** its GPUs showed no activity. Training that prints nothing for an hour (Lightning's Rich bar
into a pipe, Hugging Face's Trainer with ``disable_tqdm`` and a large ``logging_steps``) keeps a core
busy the whole time and is never cut; a process blocked on a lock, a pipe or a DataLoader whose
workers deadlocked uses none and is.

``activity_between`` turns two memory samples into what the tree did between them; ``Liveness``
folds those and the output's life signs into a ``Judgement`` the loop acts on: hung (with the
figures that decided it), held alive (and why: ``silent 42 min; busy: 97% of a core``), or neither.
Pure: the sampler's readings and the clock come in as arguments.

The CPU floor comes from measurement (``bench/idle_cpu.py``: each scenario's whole process tree,
sampled every second for 20 s after it settled, on a 2-core machine shared with other jobs, so busy
processes got a fifth of a core or so):

    =====================================================  ==========================  ==========
    scenario                                               CPU per 1 s interval        I/O
    =====================================================  ==========================  ==========
    blocked on a lock (torch's pool, tqdm's monitor)       0.0 % in every interval     0 B
    blocked reading a pipe                                 0.0 %                       0 B
    asleep                                                 0.0 %                       0 B
    DataLoader, 2 workers deadlocked on a lock             0.0 %                       0 B
    gloo all_reduce whose peer never comes (2 ranks)       0.0 %                       0 B
    HF Trainer blocked in a callback                       0.0 %                       0 B
    training loop, 1 thread                                22.6 % at least (mean 28)   MiB/s
    training with 2 DataLoader workers                     18.5 % at least (mean 25)   MiB/s
    a loop spinning, printing nothing                      18.7 % at least (mean 22)   0 B
    =====================================================  ==========================  ==========

A hung tree's only CPU is a periodic wake-up (the DataLoader's 5 s status check, gloo's and tqdm's
timers), microseconds: not one clock tick (10 ms) in a second. Work, even starved by a shared
machine, is tens of percent. The floor, 5 % of one core, is five ticks a second: clear of a stray
tick or two in a hung tree, and under a third of the least a busy one was seen to get.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.sampler import MemorySample

CPU_FLOOR = 0.05  # share of one core; see the table above
# /proc counts CPU time in clock ticks of 10 ms: over a quarter-second interval one tick is already
# 4 %. An interval shorter than this is judged as if it lasted this long, so a lone tick is noise.
MIN_SPAN = 1.0  # seconds
IO_FLOOR = 1 << 20  # bytes per second: a hung tree moved none; a checkpoint or data read moves far more
GPU_BUSY_PCT = 1  # NVML utilization: any kernel running in the driver's sample period
GPU_MEMORY_MOVED = 2 << 20  # bytes: the CUDA caching allocator's smallest segment
# The learned cadence: after this many gaps between life signs, spanning at least the floor, a
# silence this many times the longest gap seen (and never under the floor) is not the worker's rhythm.
CADENCE_GAPS = 20
CADENCE_FACTOR = 5.0
CADENCE_FLOOR = 300.0  # seconds
PUBLISH_EVERY = 10.0  # seconds between two updates of the held-alive note while it holds


@dataclass(frozen=True)
class Activity:
    """What the worker's process tree did over one sampling interval."""

    seconds: float
    cpu_seconds: float | None
    io_bytes: int | None
    gpu: str | None  # what counts as GPU activity ("GPU 0 at 87%"), or None when there was none

    @property
    def cpu_share(self) -> float | None:
        return None if self.cpu_seconds is None else self.cpu_seconds / self.seconds

    def busy(self) -> str | None:
        """Why the tree counts as busy in this interval, or None when it was idle."""
        span = max(self.seconds, MIN_SPAN)
        if self.cpu_seconds is not None and self.cpu_seconds >= CPU_FLOOR * span:
            return f"{100 * self.cpu_seconds / self.seconds:.0f}% of a core"
        if self.gpu is not None:
            return self.gpu
        if self.io_bytes is not None and self.io_bytes >= IO_FLOOR * span:
            return f"{_size(self.io_bytes)} of I/O in {self.seconds:.0f} s"
        return None


def activity_between(before: MemorySample, after: MemorySample) -> Activity | None:
    """What the tree did between two samples; None when they are not an interval."""
    seconds = after.monotonic - before.monotonic
    if seconds <= 0:
        return None
    cpu = _delta(before.worker_cpu_seconds, after.worker_cpu_seconds)
    io = _delta(before.worker_io_bytes, after.worker_io_bytes)
    return Activity(seconds, cpu, None if io is None else int(io), gpu_activity(before, after))


def gpu_activity(before: MemorySample, after: MemorySample) -> str | None:
    """GPU work by the worker between two samples: its own processes' SM share where NVML gives it
    (another job's kernels on a shared GPU are not the worker's), else the device's utilization;
    or its GPU memory moving (its own processes' figure, else the device's)."""
    earlier = {g.cuda_index: g for g in before.gpus}
    for g in after.gpus:
        if g.worker_sm_pct is not None:
            if g.worker_sm_pct >= GPU_BUSY_PCT:
                return f"GPU {g.cuda_index}: its processes at {g.worker_sm_pct}% SM"
        elif g.utilization_pct is not None and g.utilization_pct >= GPU_BUSY_PCT:
            return f"GPU {g.cuda_index} at {g.utilization_pct}%"
        old = earlier.get(g.cuda_index)
        if old is not None:
            now_bytes, old_bytes = _gpu_bytes(g), _gpu_bytes(old)
            if abs(now_bytes - old_bytes) >= GPU_MEMORY_MOVED:
                return f"GPU {g.cuda_index} memory moved {_size(abs(now_bytes - old_bytes))}"
    return None


@dataclass
class Cadence:
    """The rhythm of one kind of life sign (steps, or output lines where no steps are known)."""

    first: float | None = None
    last: float | None = None
    gaps: int = 0
    longest: float = 0.0

    def sign(self, now: float) -> None:
        if self.last is not None:
            self.gaps += 1
            self.longest = max(self.longest, now - self.last)
        else:
            self.first = now
        self.last = now

    def timeout(self) -> float | None:
        """The silence that breaks the rhythm, once enough of it was seen; None before."""
        learned = max(CADENCE_FLOOR, CADENCE_FACTOR * self.longest)
        if self.gaps < CADENCE_GAPS or self.first is None or self.last is None:
            return None
        return learned if self.last - self.first >= CADENCE_FLOOR else None

    def describe(self, what: str) -> str:
        return f"{self.gaps} gaps between {what}, the longest {self.longest:.0f} s, × {CADENCE_FACTOR:g}"


@dataclass(frozen=True)
class Judgement:
    """What the liveness check concluded at one moment. ``hung`` is the one-line reason the attempt
    ends with; ``held`` says why a worker silent past its timeout is left running."""

    hung: str | None
    held: str | None
    figures: dict[str, Any]

    def note(self, attempt: int, wall: float) -> dict[str, Any] | None:
        """What status and the dashboard show while the worker is held alive; None when it is not."""
        if self.held is None:
            return None
        return {"attempt": attempt, "text": self.held, "busy": self.figures.get("busy"),
                "silent_since": wall - self.figures["quiet_s"], "t": wall}


@dataclass
class Idle:
    """The stretch since the tree was last busy: how long, and the most it used in any interval."""

    since: float
    cpu_seconds: float = 0.0
    seconds: float = 0.0
    max_share: float = 0.0
    io_bytes: int = 0
    cpu_known: bool = False

    def add(self, activity: Activity) -> None:
        self.seconds += activity.seconds
        if activity.cpu_seconds is not None:
            self.cpu_known = True
            self.cpu_seconds += activity.cpu_seconds
            self.max_share = max(self.max_share, activity.cpu_seconds / max(activity.seconds, MIN_SPAN))
        self.io_bytes += activity.io_bytes or 0


@dataclass
class Liveness:
    """The worker's activity and life signs over one attempt, and the hang judgement they lead to."""

    started: float
    previous: MemorySample | None = None
    idle: Idle | None = None  # set by the first sample
    busy: str | None = None  # why the tree was busy in the newest busy interval
    gpu_note: str | None = None  # why there are no GPU figures, when there are none
    output: Cadence = field(default_factory=Cadence)
    steps: Cadence = field(default_factory=Cadence)
    published: tuple[bool, float] = (False, 0.0)  # (held, when) of the last note the loop published

    def add(self, sample: MemorySample) -> None:
        """One sample of the worker's tree (the sampler's, once per interval)."""
        before = self.previous or _origin(sample, self.started)
        self.previous = sample
        self.gpu_note = None if sample.gpus else (sample.gpu_unavailable or "no GPU")
        activity = activity_between(before, sample)
        if activity is None:
            return
        why = activity.busy()
        if why is not None:
            self.busy, self.idle = why, Idle(sample.monotonic)
            return
        if self.idle is None:
            self.idle = Idle(self.started)
        self.idle.add(activity)

    def timeout(self, configured: float, steps_known: bool) -> tuple[float, str]:
        """The silence that counts: ``--hang-timeout``, or sooner where a steady rhythm was learned."""
        cadence, what = (self.steps, "steps") if steps_known else (self.output, "output lines")
        learned = cadence.timeout()
        if learned is not None and learned < configured:
            return learned, f"learned cadence: {cadence.describe(what)}"
        return configured, f"--hang-timeout {configured:g}"

    def judge(self, quiet: float, configured: float, steps_known: bool, now: float) -> Judgement:
        """Hung when silent and idle for the timeout; held when silent that long but busy."""
        timeout, source = self.timeout(configured, steps_known)
        idle_since = self.idle.since if self.idle is not None else self.started
        idle_for = now - idle_since
        what = "progress" if steps_known else "output or progress"
        figures: dict[str, Any] = {"quiet_s": round(quiet, 1), "timeout_s": round(timeout, 1), "timeout_from": source,
                                   "idle_s": round(idle_for, 1), "cpu_floor_pct": 100 * CPU_FLOOR}
        if quiet < timeout:
            return Judgement(None, None, figures)
        if idle_for < timeout:
            figures["busy"] = self.busy
            ago = f" {_duration(idle_for)} ago" if idle_for >= 2 * MIN_SPAN + 1 else ""
            return Judgement(None, f"silent {_duration(quiet)}; busy{ago}: {self.busy}", figures)
        figures.update(self._idle_figures())
        return Judgement(f"no {what} for {quiet:.0f} s ({source}); {self._idle_text(idle_for)}", None, figures)

    def _idle_figures(self) -> dict[str, Any]:
        idle = self.idle
        known = idle is not None and idle.cpu_known
        return {"cpu_max_pct": round(100 * idle.max_share, 2) if idle and known else None,
                "cpu_seconds": round(idle.cpu_seconds, 3) if idle and known else None,
                "io_bytes": idle.io_bytes if idle else None, "gpu": self.gpu_note or "idle"}

    def _idle_text(self, idle_for: float) -> str:
        idle = self.idle
        if idle is None or not idle.cpu_known:
            return "no CPU figures of its processes"
        gpu = f"no GPU figures: {self.gpu_note.removeprefix('GPU figures unavailable: ')}" if self.gpu_note else (
            "its GPUs idle")
        return (f"idle for {idle_for:.0f} s: CPU at most {100 * idle.max_share:.1f}% of a core "
                f"(floor {100 * CPU_FLOOR:g}%), {_size(idle.io_bytes)} of I/O, {gpu}")

    def news(self, judgement: Judgement, now: float) -> str | None:
        """Whether the held-alive note is to be published now: "held" (a silent stretch began to be
        held), "still held" (its figures moved on), "released", or None (nothing new). Said when it
        starts, when it ends and every ``PUBLISH_EVERY`` seconds between, not with every tick."""
        held = judgement.held is not None
        was_held, when = self.published
        if held == was_held and (not held or now - when < PUBLISH_EVERY):
            return None
        self.published = (held, now)
        return "released" if not held else "still held" if was_held else "held"


def _origin(sample: MemorySample, started: float) -> MemorySample:
    """The tree as it was when the attempt started: nothing used yet."""
    return replace(sample, monotonic=started, worker_cpu_seconds=0.0 if sample.worker_cpu_seconds is not None
                   else None, worker_io_bytes=0 if sample.worker_io_bytes is not None else None, gpus=())


def _delta(before: float | int | None, after: float | int | None) -> float | None:
    if before is None or after is None:
        return None
    return max(0.0, float(after - before))  # a process that left the tree takes its time with it


def _gpu_bytes(g: GpuReading) -> int:
    return int(g.worker_bytes if g.worker_bytes is not None else g.used_bytes)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
