"""What the loop learns about one attempt while it runs: progress, checkpoints, hangs, peaks.

``AttemptWatch`` folds the worker's structured records (``common.protocol``) and the output
scanner's evidence into facts the loop and the policy read: the last step, whether a checkpoint
landed, whether the worker reported its own failure, how long it has been quiet and, with what its
processes did (``observe.liveness``), whether that quiet is a hang. It does no I/O; the loop feeds it
records and readings and carries out what follows from them.

Steps come first from the in-process probe (``observe.allocator``): real optimizer steps, counted
where they happen. The worker library's progress records and the steps read from the output are the
fallback for a worker without the probe; once the probe has reported a step in an attempt, a step
read from the output no longer moves the count (a progress bar's total still gives the ETA).

Also here:

- Training progress read from the worker's output, for scripts that do not use the worker library.
- Reading the structured records a worker appends to its events file (see common/protocol.py).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.common import protocol
from oomguard.supervisor.observe.allocator import AllocatorReport, ProbeReport
from oomguard.supervisor.observe.checkpoints import ResumeCheck, renamed_name
from oomguard.supervisor.observe.liveness import Judgement, Liveness
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.observe.sampler import AttemptPeak, MemorySample, fold_peak

# Training progress read from the worker's output, for scripts that do not use the worker library.
#
# ``StepMatcher`` maps one line of output to the step it reports (and the total, when the line shows
# one), or None. Built-in patterns cover what the common trainers print by default; ``--progress-pattern``
# adds the user's own (a regular expression with a named group ``step`` and optionally ``total``),
# tried first. Pure: the output thread feeds it lines, the loop reads what ``observe.progress`` kept.
#
# Progress only from progress: a number in a path or a file name is the step of a file
# (``ckpts/epoch=0-step=4.ckpt``, ``out/checkpoint-500``), and a line about saving, loading, restoring
# or resuming a checkpoint names the step it was written at, not the step training is at. Both are
# taken out before any pattern looks at the line. A progress bar is read before that rule, so a log
# line glued to a bar's redraw (``2/6 [00:03<00:07][transformers] Saving model checkpoint to ...``)
# still gives the bar's step. ``tests/progress_corpus/`` holds real lines captured from Lightning, the
# Hugging Face Trainer, Accelerate, nanoGPT and nanochat, each with the step it shows, and the tests
# check every one of them.


# Terminal control sequences: colours and cursor moves of a bar drawn for a terminal (Rich when it
# renders, tqdm's nested bars' cursor-up).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# Lightning's bars that are not training: their numbers are batches of another loop.
_OTHER_LOOP = re.compile(r"^\s*(?:Sanity Checking|Validation|Testing|Predicting)\b")
# A token that is a path (a slash next to a letter: ``out/checkpoint-2``, not ``45/100``), a file
# name with a known extension, or a name formatted from metrics (Lightning's ``epoch=0-step=4``).
_PATHLIKE = re.compile(
    r"""[^\s'"`\[\](){}]*(?:[A-Za-z_.~][/\\]|[/\\][A-Za-z_.~])[^\s'"`\[\](){}]*"""
    r"""|[^\s'"`\[\](){}]+\.(?:ckpt|pt|pth|bin|safetensors|pkl|pickle|json|ya?ml|npz|npy|h5|hdf5|msgpack|tar|zip"""
    r"""|gz|distcp|model|parquet)\b[^\s'"`]*"""
    r"""|[^\s'"`\[\](){}]*\w=\d+[-_]\w+=\d+[^\s'"`\[\](){}]*"""
)
# A line about a checkpoint being saved, loaded, restored or resumed from, or batches being skipped.
_CHECKPOINT_MESSAGE = re.compile(
    r"\b(?:restor\w*|resum\w*|continu\w* training|sav(?:e|es|ed|ing)|load(?:s|ed|ing)?|skip(?:s|ped|ping)?"
    r"|checkpoint\w*|ckpt)\b", re.IGNORECASE)
# A bar's own description, when it has one, must say it is training: "Map", "Writing model shards"
# and "Loading checkpoint shards" count other things.
_TRAINING_DESCRIPTION = re.compile(r"^\s*$|\b(?:epoch|train|step|iter|batch|update|optim)", re.IGNORECASE)

# Bars, read before the checkpoint-message rule. Each has the named group ``step`` and maybe ``total``
# and ``epoch``; ``per_epoch`` marks a bar that counts batches within an epoch (Lightning's).
_BARS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Lightning's Rich bar: "Epoch 2/4  ━━━━━━━━━━╸━━━━━━━━━ 5/8 0:00:04 • 0:00:03 1.69it/s v_num: 0"
    ("lightning rich",
     re.compile(r"^\s*Epoch (?P<epoch>\d+)/(?P<epochs>-?\d+)\s+[^\d\s]*\s*(?P<step>\d+)/(?P<total>\d+)\s")),
    # Lightning's TQDM bar: "Epoch 2:  45%|████▌     | 45/100 [00:03<00:04, 13.52it/s, v_num=0]"
    ("lightning tqdm", re.compile(r"^\s*Epoch (?P<epoch>\d+):.*?\|\s*(?P<step>\d+)/(?P<total>\d+) \[")),
    # tqdm (Hugging Face Trainer, Accelerate scripts): " 40%|████      | 40/100 [00:12<00:18,  3.30it/s]",
    # with or without the percentage block: "12/100 [00:01<00:09"
    ("tqdm", re.compile(r"^(?P<desc>[^|\[]*?)(?::\s*)?(?:\d+%\|[^|]*\|\s*|(?<!\S))(?P<step>\d+)/(?P<total>\d+) \[\d")),
)
# Text lines, read after it. nanoGPT: "iter 120: loss 3.2100, time 41.23ms" and "step 250: train loss 2.9";
# nanochat: "step 00120/01000 (12.00%) | loss: 3.21"; "Step: 120 / 1000"; "global_step=120"; "step 120".
_TEXT: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("nanogpt", re.compile(r"^\s*(?:iter|step) (?P<step>\d+): ")),
    ("step N/M", re.compile(r"\b(?:global_)?step[\s:=]+(?P<step>\d+)\s*/\s*(?P<total>\d+)\b", re.IGNORECASE)),
    ("step N", re.compile(r"\b(?:global[_ ])?step[\s:=]+(?P<step>\d+)\b", re.IGNORECASE)),
)


@dataclass(frozen=True)
class StepSeen:
    step: int
    total: int | None


def compile_pattern(text: str) -> re.Pattern[str]:
    """The user's ``--progress-pattern``; ValueError (naming the fix) when it cannot be used."""
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise ValueError(f"{text!r} is not a regular expression ({exc})") from None
    if "step" not in pattern.groupindex:
        raise ValueError(f"{text!r} has no named group 'step'; write e.g. 'it=(?P<step>\\d+)'")
    return pattern


class StepMatcher:
    """Line -> StepSeen or None. A custom pattern is tried before the built-ins.

    ``batches_per_step`` is the gradient accumulation the worker was given: Lightning's bars count
    batches, its checkpoints (``step=S``) and everyone else count optimizer steps.
    """

    def __init__(self, custom: str | None = None, batches_per_step: int = 1) -> None:
        self.custom = compile_pattern(custom) if custom else None
        self.batches_per_step = max(1, batches_per_step)

    def match(self, line: str) -> StepSeen | None:
        if len(line) > 2000 or not any(c.isdigit() for c in line):  # cheap exits for the common line
            return None
        if "\x1b" in line:
            line = _ANSI.sub("", line)
        if self.custom is not None and (seen := _read(self.custom.search(line))) is not None:
            return seen
        if _OTHER_LOOP.match(line):
            return None
        line = _PATHLIKE.sub(" ", line) if ("/" in line or "." in line or "=" in line or "\\" in line) else line
        for _, pattern in _BARS:
            if (m := pattern.search(line)) is not None and (seen := self._bar(m)) is not None:
                return seen
        if _CHECKPOINT_MESSAGE.search(line):
            return None
        for _, pattern in _TEXT:
            if (seen := _read(pattern.search(line))) is not None:
                return seen
        return None

    def _bar(self, m: re.Match[str]) -> StepSeen | None:
        groups = m.groupdict()
        if groups.get("desc") is not None and not _TRAINING_DESCRIPTION.search(groups["desc"]):
            return None
        step, total = int(m.group("step")), int(m.group("total"))
        if groups.get("epoch") is None:
            return StepSeen(step, total)
        # Lightning counts batches within the epoch: epoch × batches per epoch + batch, in optimizer
        # steps. The Rich bar also shows the last epoch ("Epoch 2/4"), hence the run's total.
        per = self.batches_per_step
        epochs = int(groups["epochs"]) + 1 if groups.get("epochs") and int(groups["epochs"]) >= 0 else None
        return StepSeen((int(groups["epoch"]) * total + step) // per, epochs * total // per if epochs else None)


def _read(m: re.Match[str] | None) -> StepSeen | None:
    if m is None:
        return None
    try:
        total = m.groupdict().get("total")
        return StepSeen(int(m.group("step")), int(total) if total else None)
    except (TypeError, ValueError, IndexError):  # a custom pattern whose group matched no number
        return None


PROGRESS_EVENT_EVERY = 10.0  # progress records are journaled as events at most this often
STAMP_SLACK = 0.25  # seconds: see AttemptWatch.step_at
MAX_SAVED = 4096  # the files of save records kept per attempt (the look-alike check's evidence)
MTIME_SLACK = 0.05  # seconds: a file's mtime comes from the kernel's coarse clock, a tick behind time.time()
REQUEST_COOLDOWN = 60.0  # seconds between two checkpoint requests for memory
_ALIVE = (protocol.PROGRESS, protocol.HEARTBEAT, protocol.CHECKPOINT, protocol.BATCH, protocol.STEP)


@dataclass(frozen=True)
class Save:
    """One ``torch.save`` the probe saw: when it began and returned, the optimizer step at its start,
    and the file it wrote, made real (a symlinked run directory compares equal; None for a file
    object or a buffer)."""

    began: float
    returned: float
    step: int
    path: str | None = None

    def wrote(self, real: str, directory: bool) -> bool:
        """It wrote the file at the real path ``real``, or with ``directory`` a file inside it;
        either under the temp name an atomic writer renamed to ``real`` once complete."""
        if self.path is None:
            return False
        if self.path == real or (directory and self.path.startswith(real + os.sep)):
            return True
        return self._renamed_to(real, directory)

    def _renamed_to(self, real: str, directory: bool) -> bool:
        """A save to ``ckpt.pt.tmp`` (or into ``.step_4.tmp/``) then renamed: the index only sees
        the final name, and the rename keeps the file's mtime, so the save's run still holds it."""
        assert self.path is not None
        parent, name = os.path.split(real)
        if not self.path.startswith(parent + os.sep):
            return False
        parts = self.path[len(parent) + 1:].split(os.sep)
        if (len(parts) > 1) != directory:  # a file in the temp directory, or the temp file itself
            return False
        return renamed_name(parts[0]) == name


@dataclass
class AttemptWatch:
    """What the loop learns while one attempt runs."""

    scanner: OutputScanner = field(default_factory=OutputScanner)
    last_progress: float = field(default_factory=time.monotonic)
    progress_records: int = 0
    last_step: int | None = None
    new_checkpoint: bool = False
    worker_failure: dict[str, Any] | None = None
    peak: AttemptPeak | None = None
    progress: dict[str, Any] | None = None  # the newest progress record, written with the next sample
    last_progress_event: float = -PROGRESS_EVENT_EVERY
    started: float = field(default_factory=time.monotonic)
    last_request: float = -REQUEST_COOLDOWN
    grow_to: int | None = None  # --grow: restart at this micro-batch once the next checkpoint lands
    matcher: StepMatcher = field(default_factory=StepMatcher)
    output_steps: int = 0  # step increases read from the output (scripts without the worker library)
    first_progress: float | None = None  # monotonic time of the first step seen
    first_step: int = 0
    total_steps: int | None = None  # from the output's step lines, when they show one
    steps_at: list[tuple[float, int]] = field(default_factory=list)  # (wall time, step) as steps advance
    saves: list[Save] = field(default_factory=list)  # the probe's torch.save records, the newest 64
    saved_paths: list[str] = field(default_factory=list)  # the files its torch.save wrote, made real (MAX_SAVED)
    resume: ResumeCheck | None = None  # started from a checkpoint of known step: did it resume there?
    allocator: AllocatorReport = field(default_factory=AllocatorReport)  # the probe's steps and allocator figures
    liveness: Liveness = field(init=False)  # what its processes do, and the hang judgement
    probe: ProbeReport = field(default_factory=ProbeReport)  # whether the probe is in the worker, or why not

    def __post_init__(self) -> None:
        self.liveness = Liveness(self.started)

    def feed_line(self, line: str) -> None:
        """One line of the worker's output (called by the output thread): evidence and progress."""
        self.scanner.feed(line)
        now = time.monotonic()
        self.liveness.output.sign(now)
        seen = self.matcher.match(line.rsplit("\r", 1)[-1])  # a carriage-return bar: its newest state
        if seen is not None:
            self.note_step(seen, now, time.time())

    def note_step(self, seen: StepSeen, now: float, wall: float) -> None:
        """A step read from the output. Steps only count going up: an evaluation bar's 5/10 printed
        at training step 400 is not a step back, and output without a new step is not progress."""
        if self.allocator.step is not None:  # the probe counts the steps; a bar still tells the total
            if seen.total and (self.total_steps is None or seen.total > self.total_steps):
                self.total_steps = seen.total
            return
        if self.resume is not None:
            self.resume.see(seen.step, seen.total)
        current_total = self.total_steps  # kept here: ``progress`` is cleared once journaled
        if seen.total and current_total and seen.total != current_total:
            # Another bar: a longer one is the training loop (after "Loading shards 2/2"), a
            # shorter one an evaluation inside it.
            if seen.total < current_total:
                return
            self.first_progress = None
        elif self.last_step is not None and seen.step <= self.last_step:
            return
        total = self.total_steps = seen.total or current_total
        self.output_steps += 1
        self.last_step = seen.step
        self.last_progress = now
        self.liveness.steps.sign(now)
        if self.first_progress is None:
            self.first_progress, self.first_step = now, seen.step
        self.steps_at = (self.steps_at + [(wall, seen.step)])[-256:]
        eta = None
        if total and now > self.first_progress and seen.step > self.first_step:
            rate = (seen.step - self.first_step) / (now - self.first_progress)
            eta = max(0.0, (total - seen.step) / rate)
        self.progress = {"type": protocol.PROGRESS, "step": seen.step, "total_steps": total, "eta_s": eta,
                         "t": wall, "source": "output"}

    def step_at(self, wall: float) -> int | None:
        """The step of a checkpoint whose name carries none (nanoGPT's ``ckpt.pt``) written at
        ``wall`` (its mtime): the step of the probe's ``torch.save`` that was writing then; else
        the last step the output (or the probe's step records) showed at or before it."""
        # The save whose run is nearest the mtime (inside it, or a coarse clock's tick before it).
        nearest = min(((max(s.began - wall, wall - s.returned, 0.0), -i, s.step)
                       for i, s in enumerate(self.saves)), default=None)
        if nearest is not None and nearest[0] <= MTIME_SLACK:
            return nearest[2]
        # A line is stamped when read, a beat after it was printed (and a file's mtime comes from
        # the kernel's coarse clock), so a step printed just before the save can be stamped after
        # it: allow a quarter second, less than the two iterations a later step would take.
        before = [step for t, step in self.steps_at if t <= wall + STAMP_SLACK]
        return before[-1] if before else None

    def saved_step(self, path: str, mtime: float, directory: bool) -> int | None:
        """The step of the probe's save of ``path`` (of a file inside it, for a directory), measured
        where the save ran. A file's mtime lies inside the save that wrote it (a coarse clock's tick
        either side), so a rewrite of the same name takes its own save's step; a directory's mtime is
        its last file's, which may be no save of torch's (HF writes ``trainer_state.json`` after
        ``optimizer.pt``): the newest save into it that began by then."""
        real = os.path.realpath(path)
        mine = [s for s in self.saves if s.wrote(real, directory) and s.began <= mtime + MTIME_SLACK]
        if not directory:
            mine = [s for s in mine if s.returned >= mtime - MTIME_SLACK]
        return mine[-1].step if mine else None

    @property
    def progressed(self) -> bool:
        """The attempt made progress: steps reported (by the library or the output) or a checkpoint."""
        return self.progress_records > 0 or self.output_steps > 0 or self.allocator.records > 0 or self.new_checkpoint

    def running_since(self) -> float:
        """When stable running began, for --grow-after: the first step where steps are seen (loading
        a model is not running), else the attempt's start."""
        return self.first_progress if self.first_progress is not None else self.started

    def observe(self, sample: MemorySample) -> None:
        """One memory sample of the worker: its peaks, and what its processes did since the last."""
        self.peak = fold_peak(self.peak, sample)
        self.liveness.add(sample)

    def checkpoint_landed(self, step: int | None, now: float, wall: float) -> None:
        """A new checkpoint settled: progress, and where its name carries a step (read by the
        checkpoint index from the file it found, not from the output), the step it was written at."""
        self.new_checkpoint = True
        self.last_progress = now
        if step is not None and (self.last_step is None or step > self.last_step):
            self.last_step = step
            self.progress = {"type": protocol.PROGRESS, "step": step, "total_steps": self.total_steps,
                             "eta_s": None, "t": wall, "source": "checkpoint"}

    @property
    def peak_rss(self) -> int:
        return self.peak.worker_rss_bytes if self.peak else 0

    def take(self, record: dict[str, Any], now: float) -> bool:
        """Fold one worker record in; True when it should be journaled as an event. Progress
        records are many: the meta and the attempt's last step carry them, events stay few."""
        kind = record["type"]
        if kind in _ALIVE:
            self.last_progress = now
        if kind in (protocol.STEP, protocol.OOM):
            return self._take_probe(record, now)
        if kind == protocol.SAVE:
            self._take_save(record)
            return False  # the checkpoint, once it settles, is the event
        if kind == protocol.PROGRESS:
            if self.resume is not None and isinstance(record.get("step"), int):
                self.resume.see(record["step"], record.get("total_steps"))
            self.liveness.steps.sign(now)
            self.progress_records += 1
            if self.allocator.step is None:  # the probe's count, where there is one, is the step
                self.last_step = record.get("step", self.last_step)
            self.progress = record
            return self._progress_event_due(now)
        if kind == protocol.FAILURE:
            self.worker_failure = record
        elif kind == protocol.PROBE:
            self.probe.take(record)
            return record.get("state") != "loaded"  # one per process: the meta counts them; failures are events
        return kind != protocol.HEARTBEAT

    def _progress_event_due(self, now: float) -> bool:
        if now - self.last_progress_event < PROGRESS_EVENT_EVERY:
            return False
        self.last_progress_event = now
        return True

    def _take_save(self, record: dict[str, Any]) -> None:
        """The probe's record of one ``torch.save``: when it ran and at which step (see step_at). A
        save before the process's first step says no step: the output's, if any, stands for it."""
        began, returned, step, path = record.get("started"), record.get("t"), record.get("step"), record.get("path")
        if isinstance(path, str) and len(self.saved_paths) < MAX_SAVED:  # a save before the first step wrote it too
            self.saved_paths.append(os.path.realpath(path))
        if isinstance(began, (int, float)) and isinstance(returned, (int, float)) and isinstance(step, int):
            save = Save(float(began), float(returned), step, os.path.realpath(path) if isinstance(path, str) else None)
            self.saves = (self.saves + [save])[-64:]

    def _take_probe(self, record: dict[str, Any], now: float) -> bool:
        """A probe record: a step record is progress (journaled as an event at most every
        ``PROGRESS_EVENT_EVERY``), an ``oom`` or ``probe`` record an event."""
        if not self.allocator.take(record):
            return True
        step = self.allocator.step
        assert step is not None
        if self.resume is not None:
            self.resume.see(step, self.total_steps)
        self.liveness.steps.sign(now)  # the learned cadence: from real steps
        if self.first_progress is None:
            self.first_progress, self.first_step = now, step
        stamp = record.get("t")
        wall = float(stamp) if isinstance(stamp, (int, float)) else time.time()
        if self.last_step is None or step > self.last_step or not self.steps_at:
            self.steps_at = (self.steps_at + [(wall, step)])[-256:]
        self.last_step = step
        rate = self.allocator.steps_per_s
        total = self.total_steps
        eta = max(0.0, (total - step) / rate) if total and rate else None
        self.progress = {"type": protocol.PROGRESS, "step": step, "total_steps": total, "eta_s": eta, "t": wall,
                         "source": "probe", **self.allocator.figures()}
        return self._progress_event_due(now)

    def check_hang(self, last_output: float, timeout: float, now: float) -> Judgement | None:
        """Whether the worker is hung (no output or progress for the timeout, and its processes and
        GPUs idle as long) or held alive despite its silence; None with hangs off."""
        if timeout <= 0:
            return None
        # Where steps are known (records or output), output without a new step is not progress:
        # a script printing warnings in a loop is still silent.
        steps_known = self.progress_records > 0 or self.output_steps > 0 or self.allocator.records > 0
        quiet = now - (self.last_progress if steps_known else max(last_output, self.last_progress))
        return self.liveness.judge(quiet, timeout, steps_known, now)

    def hang_reason(self, last_output: float, timeout: float, now: float) -> str | None:
        """Why the worker counts as hung, or None."""
        judgement = self.check_hang(last_output, timeout, now)
        return judgement.hung if judgement is not None else None

    def request_pending(self, request_file_exists: bool, now: float) -> bool:
        """A checkpoint request already written and still fresh is not repeated."""
        return request_file_exists and now - self.last_request < REQUEST_COOLDOWN


# Reading the structured records a worker appends to its events file (see common/protocol.py).


class ChannelReader:
    """Tails one attempt's events file; a torn last line waits for the rest of it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = [protocol.decode(line.decode("utf-8", "replace")) for line in lines if line.strip()]
        return [r for r in records if r is not None]
