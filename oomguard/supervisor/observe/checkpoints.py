"""Checkpoints and their steps: finding the newest valid one among what the worker writes.

Tested in tests/unit/supervisor/observe/test_checkpoints.py; the look-alikes in
tests/unit/supervisor/run/test_preflight.py.

The newest is the one holding the highest step where its step is known (``resolve``), else the
highest epoch or save count its name gives, else the newest mtime. One still being written is never
chosen: temp names are skipped, and while the worker runs a candidate must keep its size and mtime
for ``settle`` seconds; ``watchdog`` says when to rescan. Also here: did an attempt resume where it
was told to (``ResumeCheck``), and the files the worker writes that look like checkpoints but no
``--checkpoint`` glob matches (``LookalikeWatcher``).
"""

from __future__ import annotations

import fnmatch
import glob
import itertools
import json
import logging
import os
import re
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

# What a checkpoint's name says about its step: only a number the name labels as a step.
#
# A name is a string that only looks like a record, so it is the weakest evidence of a step
# (``resolve`` prefers the probe's save record and the checkpoint's own record). A number
# in it is read as the step only where it is labelled as one (``step=500``, ``global_step1000``,
# ``iter_0001000``, Composer's ``ba100``, fairseq's updates in ``checkpoint_3_1500.pt``) or where it is
# the name's only number, unlabelled or named by the checkpoint's own noun (HF's ``checkpoint-500``,
# ``model_000250.pt``, ``ckpt-12.pt``). Everything else is not a step: an epoch (``epoch=2``,
# ``ep3``, timm's ``checkpoint-7.pth.tar``), a version (Lightning's ``-v1``), a rank, a batch size
# (``bs16``, which oomguard itself changes), a metric (``loss=0.53``), and the numbers of a name that
# holds several unlabelled ones. An epoch, or a count of saves (accelerate's ``checkpoint_4``), still
# orders the checkpoints of one scheme among themselves: that is ``ordinal``, never reported as a step.


# Labels that name an optimizer step (or a count of them): Lightning/DeepSpeed/torchtitan ``step``,
# Megatron/mmengine ``iter``, Composer ``ba`` (its batch count: one batch is one optimizer step),
# fairseq ``updates``.
_STEP_LABELS = frozenset({"step", "steps", "globalstep", "gs", "iter", "iters", "iteration", "iterations", "it",
                          "ba", "update", "updates", "upd"})
_EPOCH_LABELS = frozenset({"epoch", "epochs", "ep"})
# The checkpoint's own noun: a number it names is "the checkpoint's number" (HF ``checkpoint-500``).
_NOUNS = frozenset({"checkpoint", "checkpoints", "ckpt", "ckpts", "chkpt", "model", "weights", "state",
                    "snapshot", "save", "saved"})
# Words whose number is something else than the checkpoint's: a sole number after one of these is no
# step even with a separator (``bs-32``, ``rank_0``, ``seed-42``), where a user's own word for the
# checkpoint (``ck-100``, ``gpt_2000``) still gives the name's number.
_NOT_STEPS = frozenset({"bs", "batch", "batchsize", "mb", "micro", "microbatch", "accum", "ga", "rank", "r", "v",
                        "ver", "version", "seed", "gpu", "gpus", "node", "nodes", "world", "fold", "shard", "part",
                        "tp", "pp", "dp", "mp", "lr", "loss", "acc", "top", "layer", "layers", "dim", "of", "best",
                        "last", "latest", "k", "n", "x"})
# Extensions stripped before reading (``.h5`` holds a digit that is no number of the checkpoint's).
_EXTENSIONS = re.compile(r"(\.(pt|pth|tar|ckpt|bin|safetensors|h5|hdf5|pkl|pickle|npz|npy|json|gz|zip|"
                         r"distcp|msgpack|onnx|keras|model|state|pdparams))+$", re.I)
# A number with the letters right before it (its label) and the separator between them; a decimal
# or a scientific number (a metric, a learning rate) is read whole so that it is never a step.
_NUMBER = re.compile(r"(?P<label>[A-Za-z]+)?(?P<sep>[-_=.]?)(?P<num>\d+(?:\.\d+)?(?:e-?\d+)?)")

# Schemes whose sole number is known not to be a step (full name, extension included).
_EPOCH_SCHEMES = (
    re.compile(r"^checkpoint(?P<n>\d+)\.pt$"),         # fairseq: checkpoint{epoch}.pt (checkpoint_utils.py)
    re.compile(r"^checkpoint-(?P<n>\d+)\.pth\.tar$"),  # timm CheckpointSaver: checkpoint-{epoch}.pth.tar
    re.compile(r"^model_(?P<n>[1-9]\d*|0)\.pth$"),     # torchvision references: model_{epoch}.pth (unpadded)
    re.compile(r"^checkpoint_(?P<n>\d+)$"),  # accelerate automatic_checkpoint_naming: its save count
)
_FAIRSEQ_UPDATES = re.compile(r"^checkpoint_(?P<epoch>\d+)_(?P<updates>\d+)\.pt$")  # checkpoint_{epoch}_{updates}.pt

@dataclass(frozen=True)
class NameReading:
    """What a name says: the step, and a number that orders its scheme's checkpoints without being one."""

    step: int | None
    ordinal: int | None = None


@dataclass(frozen=True)
class _Number:
    label: str  # lower case, "" when none
    sep: str  # between the label and the number: "", "-", "_", "=" or "."
    text: str

    @property
    def whole(self) -> int | None:
        return int(self.text) if self.text.isdigit() else None


def read_name(name: str) -> NameReading:
    """The step a checkpoint's base name says, where it says one (see the module's docstring)."""
    known = _known_scheme(name)
    if known is not None:
        return known
    numbers = [_Number((m["label"] or "").lower(), m["sep"], m["num"])
               for m in _NUMBER.finditer(_EXTENSIONS.sub("", name))]
    steps = {n.whole for n in numbers if n.label in _STEP_LABELS and n.whole is not None}
    epochs = {n.whole for n in numbers if n.label in _EPOCH_LABELS and n.whole is not None}
    ordinal = next(iter(epochs)) if len(epochs) == 1 else None
    if steps:  # two different step labels in one name: which one the trainer counts is unknown
        return NameReading(steps.pop() if len(steps) == 1 else None, ordinal)
    if len(numbers) == 1 and _the_checkpoints_own(numbers[0]):
        return NameReading(numbers[0].whole, ordinal)
    return NameReading(None, ordinal)


def _known_scheme(name: str) -> NameReading | None:
    """A framework's scheme whose numbers the label rules would misread."""
    for scheme in _EPOCH_SCHEMES:
        if m := scheme.match(name):
            return NameReading(None, int(m["n"]))
    if m := _FAIRSEQ_UPDATES.match(name):
        return NameReading(int(m["updates"]), int(m["epoch"]))
    return None


def _the_checkpoints_own(number: _Number) -> bool:
    """A name's only number is its step when unlabelled, named by the checkpoint's noun, or by a word of
    the user's own set apart by ``-`` or ``_`` (``ck-100``); not glued to a word (``gpt2``), after ``=``
    (a metric's form) or after a word that names something else (``bs-32``, ``rank_0``)."""
    if number.whole is None:
        return False
    if not number.label:
        return True
    if number.sep == "=":
        return False
    if number.label in _NOUNS:
        return True
    return number.sep in ("-", "_") and number.label not in _NOT_STEPS and number.label not in _EPOCH_LABELS


# The step a checkpoint holds, from the best evidence there is, and which evidence that was.
#
# In order: (1) the probe's ``save`` record of the file, or of a file inside the checkpoint's
# directory, either under the temp name an atomic writer renamed into place
# (``AttemptWatch.saved_step``): the optimizer's own count when the save began, measured in the
# worker; (2) the checkpoint's own record where reading it is cheap and safe (HF's
# ``trainer_state.json``, whose ``global_step`` its ``checkpoint-N`` name repeats); (3) its name,
# only a number labelled as a step or the name's sole number (``read_name``); (4) the step
# the worker reported when the file was written (``AttemptWatch.step_at``); else unknown, and said
# so, never guessed.
#
# A measured step beats a name that says another: every other step oomguard reports (progress, the
# resume check, the journal, ``{checkpoint_step}`` for a worker whose optimizer keeps no count) is
# the optimizer's count, and names count other things under the same label: accelerate's examples
# name ``step_{overall_step}``, a count of micro-batches that is ``grad_accum`` times the optimizer's
# under gradient accumulation (which oomguard raises as it halves the micro-batch).


SAVE = "save"  # the probe's save record
OWN_RECORD = "trainer_state"  # HF's trainer_state.json in the checkpoint directory
NAME = "name"
OUTPUT = "output"  # the step reported when the file was written
JOURNAL = "journal"  # the step the journal kept for it, resolved by an earlier supervisor on the run
_STATE_MAX_BYTES = 16 * 2**20  # its log history grows with the run; a larger file is not read


@dataclass(frozen=True)
class StepEvidence:
    step: int | None
    source: str | None  # one of the sources above; None when the step is unknown


def resolve(saved: int | None, own: StepEvidence, by_time: int | None) -> StepEvidence:
    """The best of the evidence: the probe's save record, the checkpoint's own (its record or its
    name, as the index found it), the step reported at its mtime; unknown when none says one."""
    if saved is not None:
        return StepEvidence(saved, SAVE)
    if own.step is not None:
        return own
    if by_time is not None:
        return StepEvidence(by_time, OUTPUT)
    return StepEvidence(None, None)


def recorded_step(path: str) -> int | None:
    """``global_step`` from ``<path>/trainer_state.json`` (HF Trainer writes it into each
    ``checkpoint-N``), or None where there is none, it is too large, or it does not parse."""
    state = os.path.join(path, "trainer_state.json")
    try:
        st = os.stat(state)
    except OSError:
        return None
    if st.st_size > _STATE_MAX_BYTES:
        return None
    return _global_step(state, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=256)
def _global_step(state: str, mtime_ns: int, size: int) -> int | None:
    """Read once per version of the file (the index rescans on every change in the directory)."""
    try:
        with open(state, encoding="utf-8") as f:
            step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


# Names that writers use while a checkpoint is incomplete (torch.save to a temp, HF/our own temp dirs).
_TEMP = re.compile(r"(^\.|\.tmp|tmp[-_.]|[-_.]tmp|\.partial$|\.part$|\.incomplete$|~$|\.lock$)", re.I)
_TEMP_HEAD = re.compile(r"^\.?(?:tmp[-_.])?", re.I)  # what renamed_name strips from a temp name's front
_TEMP_TAIL = re.compile(r"(?:\.tmp\d*|[-_.]tmp|\.partial|\.part|\.incomplete|~)$", re.I)  # and its end


@dataclass(frozen=True)
class Checkpoint:
    path: str
    step: int | None
    mtime: float
    size: int
    ordinal: int | None = None  # an epoch or save count from the name: orders, is never a step
    step_from: str | None = None  # which evidence gave the step (``resolve``); None if unknown

    @property
    def signature(self) -> tuple[float, int]:
        return (self.mtime, self.size)


def is_temp_name(name: str) -> bool:
    """A name writers use while a checkpoint is incomplete (``.checkpoint-4.tmp``, ``x.pt.partial``)."""
    return _TEMP.search(name) is not None


def renamed_name(name: str) -> str | None:
    """The name a writer renames the temp ``name`` to once complete (``.step_2.pt.tmp``, ``tmp-ckpt-6``:
    without its temp marks), or None where it is no temp name or nothing is left of it."""
    if not is_temp_name(name):
        return None
    final = _TEMP_TAIL.sub("", _TEMP_HEAD.sub("", name, count=1), count=1)
    return final if final and final != name else None


class _StopRace(logging.Filter):
    """watchdog 7's inotify emitter logs an error for an event that races its ``stop()`` (PR #963): it
    loses nothing we read, but would print on the user's terminal after the run ended."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


def quiet_stop_race() -> None:
    """Filter the stop race out of watchdog's inotify logger (once, whoever starts an observer)."""
    logger = logging.getLogger("watchdog.observers.inotify")
    if not any(isinstance(f, _StopRace) for f in logger.filters):
        logger.addFilter(_StopRace())


def _stop(observer: BaseObserver | None) -> None:
    if observer is not None:
        observer.stop()
        observer.join(timeout=2)


def step_of(path: str) -> int | None:
    """The step a checkpoint's name labels as one, if any (``read_name``)."""
    return read_name(Path(path).name).step


def own_step(path: str) -> StepEvidence:
    """The step a checkpoint says itself: its own record (a directory's ``trainer_state.json``), else
    its name. The probe's save record, stronger than both, is the loop's to add (``learn``)."""
    recorded = recorded_step(path) if os.path.isdir(path) else None
    if recorded is not None:
        return StepEvidence(recorded, OWN_RECORD)
    named = step_of(path)
    return StepEvidence(named, NAME if named is not None else None)


def _stat(path: str) -> tuple[float, int] | None:
    """(newest mtime, total size) of a file or of everything in a directory; None if it vanished."""
    try:
        if not os.path.isdir(path):
            st = os.stat(path)
            return st.st_mtime, st.st_size
        mtime, size = os.stat(path).st_mtime, 0
        for root, _dirs, files in os.walk(path):
            for name in files:
                st = os.stat(os.path.join(root, name))
                mtime, size = max(mtime, st.st_mtime), size + st.st_size
        return mtime, size
    except OSError:
        return None


def scan(patterns: Iterable[str], cwd: Path, learned: Mapping[str, tuple[float, StepEvidence]] | None = None
         ) -> list[Checkpoint]:
    """Every checkpoint the globs match now, temp names excluded, newest first. ``learned``: the
    step the loop resolved for a path, kept while the file has the mtime it had then."""
    found: dict[str, Checkpoint] = {}
    for pattern in patterns:
        full = pattern if os.path.isabs(pattern) else str(cwd / pattern)
        for path in glob.glob(full, recursive=True):
            if is_temp_name(Path(path).name) or (stat := _stat(path)) is None:
                continue
            path = os.path.abspath(path)
            known = learned.get(path) if learned else None
            step = known[1] if known is not None and known[0] == stat[0] else own_step(path)
            found[path] = Checkpoint(path, step.step, *stat, read_name(Path(path).name).ordinal, step.source)
    # A known step first (any step outranks none), then an epoch or save count, then the mtime.
    return sorted(found.values(), reverse=True, key=lambda c: (
        c.step if c.step is not None else -1, c.ordinal if c.ordinal is not None else -1, c.mtime))


class _Dirty(FileSystemEventHandler):
    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.flag.set()


def _watch_roots(patterns: Iterable[str], cwd: Path) -> set[str]:
    """The deepest existing directory above each glob's first wildcard."""
    roots = set()
    for pattern in patterns:
        parts = list(itertools.takewhile(lambda part: not glob.has_magic(part), (cwd / pattern).parts))
        root = Path(*parts) if parts else Path("/")
        while not root.is_dir() and root != root.parent:
            root = root.parent
        roots.add(str(root))
    return roots


class CheckpointIndex:
    """The checkpoints of a run, kept current while the worker runs."""

    def __init__(self, patterns: Iterable[str], cwd: Path, settle: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.patterns = tuple(patterns)
        self.cwd = cwd
        self.settle = settle
        self.clock = clock  # injectable: the tests script how long a file has been still
        self._dirty = threading.Event()
        self._dirty.set()
        self._observer: BaseObserver | None = None
        self._seen: dict[str, tuple[tuple[float, int], float]] = {}  # path -> (signature, since)
        self._current: list[Checkpoint] = []
        self._learned: dict[str, tuple[float, StepEvidence]] = {}  # path -> (mtime, step the loop resolved)

    def directories(self) -> list[Path]:
        """The directories the checkpoints are written in: each glob's path above its first wildcard,
        never the working directory or one above it (``ckpt-*`` there names no directory of its own)."""
        roots = []
        for pattern in self.patterns:
            full = self.cwd / pattern
            magic = next((i for i, part in enumerate(full.parts) if glob.has_magic(part)), len(full.parts) - 1)
            root = Path(*full.parts[:magic])
            if root != self.cwd and root not in self.cwd.parents:
                roots.append(root)
        return roots

    def start(self) -> str:
        """Start watching; returns which observer is in use."""
        if not self.patterns:
            return "none"
        # watchdog 7 re-adds the watch of a directory renamed inside the tree (a checkpoint written to
        # a temp dir, then renamed into place) and warns with its whole watch table, kilobytes per
        # rename on the user's terminal. The watch stays correct; the warning says nothing to them.
        warnings.filterwarnings("ignore", message="Callback with id .* already exists for watch",
                                category=RuntimeWarning)
        quiet_stop_race()
        for observer_type in (Observer, PollingObserver):
            observer = observer_type()
            try:
                for root in _watch_roots(self.patterns, self.cwd):
                    observer.schedule(_Dirty(self._dirty), root, recursive=True)
                observer.start()
            except OSError:
                continue  # e.g. inotify watches exhausted, or a filesystem without inotify
            self._observer = observer
            return type(observer).__name__
        return "rescan"

    def stop(self) -> None:
        _stop(self._observer)
        self._observer = None

    def refresh(self, force: bool = False) -> list[Checkpoint]:
        """Rescan if something changed (or while candidates are still settling)."""
        settling = any(since > self.clock() - self.settle for _, since in self._seen.values())
        if force or self._dirty.is_set() or settling or self._observer is None:
            self._dirty.clear()
            self._current = scan(self.patterns, self.cwd, self._learned)
            self._learned = {c.path: self._learned[c.path] for c in self._current if c.path in self._learned}
            now = self.clock()
            seen = {}
            for c in self._current:
                old = self._seen.get(c.path)
                seen[c.path] = old if old and old[0] == c.signature else (c.signature, now)
            self._seen = seen
        return self._current

    def learn(self, checkpoint: Checkpoint, step: StepEvidence) -> None:
        """The step the loop resolved for ``checkpoint`` (the probe's save record outranks the name):
        it orders the checkpoints from the next scan on, until the file is written again."""
        if step.step is not None and step != StepEvidence(checkpoint.step, checkpoint.step_from):
            self._learned[checkpoint.path] = (checkpoint.mtime, step)
            self._dirty.set()

    def settled(self, exclude: set[str] = frozenset()) -> list[Checkpoint]:  # type: ignore[assignment]
        """Checkpoints whose size and mtime have not changed for ``settle`` seconds, newest first."""
        cutoff = self.clock() - self.settle
        return [c for c in self.refresh() if c.path not in exclude and self._seen[c.path][1] <= cutoff]

    def newest(self, exclude: set[str], worker_alive: bool) -> Checkpoint | None:
        """The checkpoint to resume from. With the worker dead nothing is still being written, so
        every candidate counts (a truncated one is caught when the worker fails to load it)."""
        candidates = self.settled(exclude) if worker_alive else [
            c for c in self.refresh(force=True) if c.path not in exclude]
        return candidates[0] if candidates else None

    def still_there(self, checkpoint: Checkpoint | None, exclude: set[str]) -> Checkpoint | None:
        """``checkpoint`` if it still exists; else the newest one that does (rotation such as HF's
        ``save_total_limit`` deletes old ones, and a chosen one can vanish before the worker starts)."""
        if checkpoint is None or os.path.exists(checkpoint.path):
            return checkpoint
        return self.newest(exclude | {checkpoint.path}, worker_alive=False)


# Did the attempt start where it was told to? Its first step against the checkpoint's step.
#
# An attempt started from a checkpoint at step N must show (in its output, or in the worker
# library's progress records) a first step past N. A script that was not really handed the
# checkpoint (a resume flag it ignores, a fixed path it does not read) starts over at step 1 and
# every failure quietly redoes everything; ``ResumeCheck`` turns its first step into a verdict the
# loop says at once, and the report counts the steps that were really redone.
#
# Which first step counts:
#
# - step 0 does not: a progress bar prints ``0/100`` when it is drawn, before a resumed Trainer
#   jumps it to N+1; a script that did start over shows step 1 next;
# - a bar whose total is at most N does not: the training that reached step N runs to more than N,
#   so a shorter bar is another one (``Loading checkpoint shards 1/2``, an evaluation's 5/50);
# - a first step of N - 1 or more is a resume. Scripts number steps differently: a checkpoint
#   ``step-N`` may be followed by step N+1 (saved after step N, counted from 1), by step N itself
#   (nanoGPT saves before running iteration N, whose step a resumed run prints again), or by N - 1
#   (a step read off the output a beat late, or counted from 0). ``MARGIN`` = 2 covers those; a first
#   step at N - 2 or below means at least two steps redone that no numbering explains. (With N of 1
#   or 2, a start over cannot be told from a numbering and is not said.)


MARGIN = 2


@dataclass(frozen=True)
class ResumeVerdict:
    path: str  # the checkpoint the attempt was started from
    step: int  # its step
    first_step: int  # the first step the attempt showed

    @property
    def resumed(self) -> bool:
        return self.first_step > self.step - MARGIN

    def message(self, hint: str) -> str:
        """One line for the console, the journal, status and the notification."""
        name = Path(self.path).name
        if self.first_step <= 1:
            return f"the script started over at step {self.first_step}, not from {name}: {hint}"
        return (f"the script went back to step {self.first_step}, not on from {name} (step {self.step}): "
                f"{self.step - self.first_step + 1} step(s) redone; {hint}")


class ResumeCheck:
    """Fed every step an attempt shows (from two threads); the verdict is the first one that counts."""

    def __init__(self, path: str, step: int) -> None:
        self.path = path
        self.step = step
        self._first: int | None = None
        self._lock = threading.Lock()

    def see(self, step: int, total: int | None = None) -> None:
        if step < 1 or (total is not None and total <= self.step):
            return
        with self._lock:
            if self._first is None:
                self._first = step

    @property
    def verdict(self) -> ResumeVerdict | None:
        with self._lock:
            first = self._first
        return None if first is None else ResumeVerdict(self.path, self.step, first)


# Files the worker writes that look like checkpoints: what a ``--checkpoint`` glob that matches nothing missed.
#
# A glob that matches nothing (``checkpoints/*.pt`` while the script writes ``out/step-N.pt``) used to
# throw a night's progress away in silence: every restart started over. ``LookalikeWatcher`` watches
# the worker's working directory, and the output directories its
# command names (``--output_dir out``, ``--save-dir=/scratch/run``) or it creates, for what the worker
# writes that looks like a checkpoint: a ``.pt``, ``.pth``, ``.ckpt`` or ``.safetensors`` file, a
# ``checkpoint-N/`` directory, a name with ``step`` and a number (``step_100/``, ``global_step100/``).
# Names being written (``.checkpoint-4.tmp``) and hidden directories are left out. This is the
# process's evidence (files it wrote), not its words.
#
# Only the worker's own writes count: anything may write under the working directory while the run
# goes (a ``cp`` of another experiment's ``best_model.pt`` from another shell, a ``pip install``), and
# telling the user to point ``--checkpoint`` at such a file would resume another run's weights. A
# look-alike is the worker's when the probe's ``save`` record names it (the path the worker's
# ``torch.save`` was given, or the temp name an atomic writer renamed to it, or a file inside it) or
# when one of the worker's processes held it open for writing as its write was reported
# (``held_for_writing`` below: the evidence where the probe does not speak). Any other is never named,
# and the notice below that says nothing was written does not say so while one was.
#
# ``missed_notice`` and ``unmatched_notice`` say when to tell the user, once, and what:
#
# - the worker wrote a look-alike no glob matches, in a directory no glob looks in: said as soon as
#   it is seen (the glob is a matter of names: the file need not be finished for the index to miss
#   it), while the attempt that wrote it still runs, not after the restart that would have resumed
#   from it. The notice names the files and the glob they suggest (digits in the name become ``*``);
# - one beside the files a glob watches (nanochat's ``optim_N.pt`` next to ``model_N.pt``) is a part
#   of a checkpoint once the globs match something; while they match nothing it is said once it has
#   been still for ``SETTLE`` seconds and the script showed a later step (the index, which counts a
#   file still for a second, would have matched it by then if it could);
# - or nothing like a checkpoint was written, yet the globs have matched nothing through
#   ``QUIET_LIMIT`` seconds (30 min) of training. Most scripts save more often than that (Hugging
#   Face's default 500 steps, nanoGPT's 2000 iterations are minutes); a restart now would lose all
#   of it, so even a script that saves rarely is better told once than not at all.


# Which files the worker's processes hold open for writing: the kernel's word that the worker wrote one.
#
# An inotify event says a file under the working directory was written, not by whom: a ``cp`` from
# another shell, a ``pip install``, another experiment's job look the same. Where the probe speaks,
# its ``save`` records name the files the worker's ``torch.save`` wrote; where it does not (a program
# that is not Python, ``--no-probe``, a file written without ``torch.save``), the only sound evidence
# short of privileged kernel interfaces (fanotify's writer pid needs CAP_SYS_ADMIN) is the open file
# itself: ``/proc/<pid>/fd/<n>`` links to it and ``/proc/<pid>/fdinfo/<n>``'s ``flags`` carry
# ``O_WRONLY`` or ``O_RDWR`` while one of the worker's processes writes it.
#
# The look is taken when inotify reports the write (within milliseconds: the file is created, then
# written), so a file written and closed faster than that (a small ``torch.save``, a ``write_text``)
# may not be seen here: a missing answer, never a wrong one. A large checkpoint, whose write takes
# seconds, is. The processes asked are the worker's as last sampled (every ``--sample-interval``): one
# it started since is not asked, and a process that is not the worker's never is.


MAX_FDS = 65536  # descriptors looked at per process: a pathological table is not read whole


def held_for_writing(pids: Iterable[int], paths: Collection[str]) -> set[str]:
    """Those of ``paths`` (real, absolute) that one of ``pids`` holds open for writing now."""
    held: set[str] = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)[:MAX_FDS]
        except OSError:  # gone, or not ours to read: no evidence
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target in paths and target not in held and _writable(pid, fd):
                held.add(target)
    return held


def _writable(pid: int, fd: str) -> bool:
    """The descriptor was opened for writing (its access mode, from ``fdinfo``'s octal ``flags``)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    except (OSError, ValueError, IndexError):
        return False
    return False


SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")
SETTLE = 3.0  # seconds a look-alike beside the watched files must have been still before it is named
QUIET_LIMIT = 1800.0  # seconds of training with nothing matched and nothing like a checkpoint written
MAX_FOUND = 1000  # look-alikes kept (the newest writes win a place; the notice names a few)
MAX_ROOTS = 16  # directories watched recursively: each is an inotify instance of the user's 128
MAX_OWN = 20000  # paths (and their directories) known to be the worker's writes; later ones go unproven
RECHECK = 0.2  # seconds between two looks at who holds the same file open
_OUTPUT_NAME = re.compile(r"^(out|save|ckpt|checkpoint|run|result|model|experiment|log|weight)", re.IGNORECASE)
_CHECKPOINT_DIR = re.compile(r"^(checkpoint|ckpt)[-_]?\d+$", re.IGNORECASE)
_OUTPUT_OPTION = re.compile(r"^--?[\w.-]*(out|save|ckpt|checkpoint)[\w.-]*$", re.IGNORECASE)
_WRITES = ("created", "modified", "moved", "closed")


@dataclass(frozen=True)
class Lookalike:
    path: str  # absolute: a file, or the checkpoint directory a file was written into
    written: float  # wall time of the newest write seen
    own: bool = False  # seen written by the worker (its probe's save record, or its open file)


def _has_step(name: str) -> bool:
    return "step" in name.lower() and any(c.isdigit() for c in name)


def candidate(path: str, root: str, is_dir: bool) -> str | None:
    """The checkpoint a write at ``path`` (under ``root``) belongs to, or None when it is none."""
    rel = os.path.relpath(path, root)
    if rel == "." or rel.startswith(".."):
        return None
    parts = Path(rel).parts
    for i, part in enumerate(parts):
        if _hidden(part):
            return None  # hidden, a cache, or a checkpoint still being written
        inner = i < len(parts) - 1 or is_dir
        if inner and (_CHECKPOINT_DIR.match(part) or _has_step(part)):
            return os.path.join(root, *parts[:i + 1])
    name = parts[-1]
    if not is_dir and (name.lower().endswith(SUFFIXES) or _has_step(name)):
        return os.path.join(root, rel)
    return None


def final_path(rel: str) -> str:
    """``rel`` as an atomic writer renames it into place (``out/.step-4.pt.tmp`` -> ``out/step-4.pt``,
    ``out/.step_4.tmp/model.pt`` -> ``out/step_4/model.pt``); a name only hidden (``.cache``) stays."""
    parts = rel.split(os.sep)
    tail = [(renamed_name(part) if is_temp_name(part.lstrip(".")) else None) or part for part in parts[-2:]]
    return os.sep.join([*parts[:-2], *tail])


def suggest_glob(paths: Sequence[str], cwd: Path) -> str:
    """The glob most of ``paths`` fit, digits made ``*`` (``out/step-2.pt`` -> ``out/step-*.pt``)."""
    patterns: Counter[str] = Counter()
    for path in paths:
        head, name = os.path.split(_shown(path, cwd))
        patterns[os.path.join(head, re.sub(r"\d+", "*", name))] += 1
    return patterns.most_common(1)[0][0]


def output_dirs(command: Sequence[str], cwd: Path) -> list[Path]:
    """The directories the command's output options name (``--output_dir out``, ``--save-dir=x``), absolute."""
    found: list[Path] = []
    words = list(command)
    for i, word in enumerate(words):
        option, eq, value = word.partition("=")
        if not word.startswith("-") or not _OUTPUT_OPTION.match(option):
            continue
        if not eq:
            value = words[i + 1] if i + 1 < len(words) else ""
        if not value or value.startswith("-") or "{" in value:
            continue
        path = cwd / value
        found.append(path.parent if path.suffix.lower() in SUFFIXES else path)
    return found


def matched(path: str, globs: Sequence[str], cwd: Path) -> bool:
    """Does one of the ``--checkpoint`` globs match ``path`` (a look-alike), or a directory above it?
    fnmatch's ``*`` also crosses ``/``: a doubt is read as a match, never as a false alarm."""
    candidates = [path, *(str(p) for p in Path(path).parents)]
    return any(fnmatch.fnmatchcase(c, p) for p in _absolute(globs, cwd) for c in candidates)


def beside(path: str, globs: Sequence[str], cwd: Path) -> bool:
    """Is ``path`` in a directory one of the globs looks in?"""
    return any(fnmatch.fnmatchcase(os.path.dirname(path), os.path.dirname(p)) for p in _absolute(globs, cwd))


def _absolute(globs: Iterable[str], cwd: Path) -> list[str]:
    return [os.path.normpath(cwd / g) for g in globs]


def missed(found: Sequence[Lookalike], globs: Sequence[str], cwd: Path, any_matched: bool,
           last_step_wall: float | None, now: float) -> list[Lookalike]:
    """The look-alikes to name now (see the module): none a glob matches; one beside the watched
    files only while the globs match nothing, once settled."""
    out = []
    for f in found:
        if matched(f.path, globs, cwd):
            continue
        settled = now - f.written >= SETTLE and last_step_wall is not None and last_step_wall > f.written
        if not beside(f.path, globs, cwd) or (not any_matched and settled):
            out.append(f)
    return out


def missed_notice(globs: Sequence[str], missed: Sequence[Lookalike], any_matched: bool, cwd: Path) -> str:
    """The line for look-alikes no glob matches (``missed``, oldest first)."""
    shown = " ".join(repr(g) for g in globs)
    paths = [f.path for f in missed]
    names = [_shown(p, cwd) for p in paths[-3:]]
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    use = f"use --checkpoint '{suggest_glob(paths, cwd)}'"
    if not any_matched:
        return (f"--checkpoint {shown} matches nothing, but the script wrote {', '.join(names)}{more}: a restart "
                f"would start over; {use}")
    return (f"--checkpoint {shown} does not match {', '.join(names)}{more}, which the script wrote and which "
            f"looks like a checkpoint: a restart would not resume from it; {use}")


def unmatched_notice(globs: Sequence[str], first_step_wall: float | None, last_step: int | None, now: float,
                     cwd: Path, watched: Sequence[Path], others: bool = False) -> str | None:
    """What to say about globs that have matched nothing while the script wrote nothing like a
    checkpoint (``others``: nothing it was seen writing), or None while it is too early."""
    shown = " ".join(repr(g) for g in globs)
    if first_step_wall is None or now - first_step_wall < QUIET_LIMIT:
        return None
    where = ", ".join(_shown(str(p), cwd) or "." for p in watched) or str(cwd)
    step = f" (to step {last_step})" if last_step is not None else ""
    written = ("the script was not seen writing anything that looks like a checkpoint" if others
               else "nothing that looks like a checkpoint was written")
    return (f"--checkpoint {shown} has matched nothing in {(now - first_step_wall) / 60:.0f} min of training{step}, "
            f"and {written} in {where}: a restart would start over; "
            "check the glob, and that the script saves checkpoints")


def _shown(path: str, cwd: Path) -> str:
    rel = os.path.relpath(path, cwd)
    return path if rel.startswith("..") else ("" if rel == "." else rel)


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _hidden(name: str) -> bool:
    return name.startswith(".") or name == "__pycache__" or is_temp_name(name)


class _Writes(FileSystemEventHandler):
    def __init__(self, watcher: LookalikeWatcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        kind = event.event_type
        if kind in _WRITES:
            path = os.fsdecode(event.dest_path if kind == "moved" else event.src_path)
            if kind == "moved":
                self.watcher.moved(os.fsdecode(event.src_path), path)
            # created or moved: a new name; created or modified: being written (closed: no one holds it now)
            self.watcher.saw(path, event.is_directory, kind in ("created", "moved"), kind in ("created", "modified"))


class LookalikeWatcher:
    """Look-alikes the worker writes in ``cwd`` (not recursively: a virtualenv or a dataset would cost
    a kernel watch per directory) and, recursively, in the output directories the command names, those
    in ``cwd`` named like outputs, and those the worker creates there. Without inotify nothing is
    watched (polling a tree would cost more than it is worth). ``pids``: the worker's processes."""

    def __init__(self, cwd: Path, outputs: Iterable[Path], ignore: Iterable[Path],
                 pids: Callable[[], Sequence[int]] = tuple) -> None:
        self.cwd = cwd.resolve()
        self.pids = pids
        self.ignore = tuple(str(p.resolve()) for p in ignore)
        self.roots: list[Path] = []  # watched recursively
        self.pending: list[Path] = []  # to be watched recursively once they exist
        for path in [*outputs, *_output_like(self.cwd)]:
            self._add(path.resolve())
        self.problem: str | None = None
        self._found: dict[str, float] = {}
        self._own: set[str] = set()  # files the worker wrote, as renamed into place, and their directories
        self._looked: dict[str, float] = {}  # monotonic time of the last look at who writes a file
        self._moves: dict[str, str] = {}  # renames seen (an atomic writer's temp name -> its final name)
        self._lock = threading.Lock()
        self._observer: BaseObserver | None = None
        self._starting: threading.Thread | None = None
        self._handler = _Writes(self)

    def _add(self, path: Path, later: bool = False) -> None:
        """Watch ``path`` recursively: now when it exists, else (or ``later``) from the loop's next look on."""
        known = [*self.roots, *self.pending]
        if path == self.cwd or any(path.is_relative_to(r) for r in known) or len(known) >= MAX_ROOTS:
            return
        if self._ignored(str(path)):
            return
        (self.roots if path.is_dir() and not later else self.pending).append(path)

    def start(self) -> None:
        """Watch from a thread, so that scheduling the watches never holds up the first attempt."""
        quiet_stop_race()
        self._starting = threading.Thread(target=self._start, name="oomguard-lookalikes", daemon=True)
        self._starting.start()

    def _start(self) -> None:
        observer = Observer()
        try:
            observer.schedule(self._handler, str(self.cwd), recursive=False)
            for root in self.roots:
                observer.schedule(self._handler, str(root), recursive=True)
            observer.start()
        except OSError as exc:  # inotify instances or watches exhausted, a filesystem without inotify
            self.problem = f"{self.cwd}: {exc.strerror or exc}"
            return
        self._observer = observer

    def stop(self) -> None:
        if self._starting is not None:
            self._starting.join(timeout=30)
        _stop(self._observer)
        self._observer = None

    def saw(self, path: str, is_dir: bool, created: bool = False, writing: bool = False) -> None:
        """A write (on watchdog's thread): kept when it belongs to a look-alike, and with ``writing`` (not
        a rename or a walk) the worker's when one of its processes holds the file open for writing."""
        if self._ignored(path):
            return
        root = self._root_of(path)
        if root is None:
            return
        found = candidate(path, root, is_dir)
        if found is None and is_dir and created and os.path.dirname(path) == str(self.cwd) \
                and not _hidden(os.path.basename(path)):
            with self._lock:
                self._add(Path(path), later=True)
        if writing and not is_dir:
            self._look_who_writes(path, root)
        if found is None:
            return
        with self._lock:
            _newest(self._found, found, time.time())

    def found(self) -> list[Lookalike]:
        """The look-alikes written so far, each saying whether the worker wrote it (the loop's thread:
        pending directories that now exist are watched from here on)."""
        self._watch_pending()
        with self._lock:
            return [Lookalike(p, t, p in self._own) for p, t in self._found.items()]

    def saved(self, paths: Iterable[str]) -> None:
        """The files the probe's ``save`` records say the worker's ``torch.save`` wrote."""
        for path in paths:
            root = self._root_of(path, [*self.roots, *self.pending])  # a save may create its directory
            if root is not None:
                self._wrote(path, root)

    def _ignored(self, path: str) -> bool:
        return any(_under(path, ignored) for ignored in self.ignore)

    def _root_of(self, path: str, roots: Sequence[Path] | None = None) -> str | None:
        """The watched directory ``path`` lies in (the deepest of ``cwd`` and ``roots``), or None."""
        dirs = [self.cwd, *(self.roots if roots is None else roots)]
        return max((str(r) for r in dirs if _under(path, str(r))), key=len, default=None)

    def _look_who_writes(self, path: str, root: str) -> None:
        """Is one of the worker's processes writing ``path`` (a file that is, or is renamed to, a
        look-alike) now? Looked at once per ``RECHECK`` seconds per file: a large save reports
        thousands of writes."""
        rel = os.path.relpath(path, root)
        if candidate(os.path.join(root, final_path(rel)), root, False) is None \
                and not is_temp_name(os.path.basename(path)):
            return
        now = time.monotonic()
        with self._lock:
            if path in self._own or now - self._looked.get(path, -RECHECK) < RECHECK:
                return
            _newest(self._looked, path, now)
        pids = tuple(self.pids())
        if pids and held_for_writing(pids, {os.path.realpath(path)}):
            self._wrote(path, root)

    def moved(self, src: str, dest: str) -> None:
        """A rename (on watchdog's thread): what the worker wrote stays its under the new name,
        whether its evidence came first or comes later (a save record arrives after the rename)."""
        root = self._root_of(dest)
        if root is None or self._ignored(dest):
            return
        with self._lock:
            _newest(self._moves, src, dest)
            if src in self._own:
                self._mark(dest, root)

    def _wrote(self, path: str, root: str) -> None:
        """The worker wrote ``path``: it, under the name a rename gave it (or an atomic writer will), and
        each directory between it and ``root`` are the worker's (a look-alike may be a directory)."""
        with self._lock:
            renamed = self._moved_to(path, root)
            final = renamed or os.path.join(root, final_path(os.path.relpath(path, root)))
            for written in (path, final):
                self._mark(written, root)

    def _moved_to(self, path: str, root: str) -> str | None:
        """Where a rename seen took ``path``, itself or a directory above it (the lock held)."""
        above = path
        while _under(above, root) and above != root:
            if above in self._moves:
                return self._moves[above] + path[len(above):]
            above = os.path.dirname(above)
        return None

    def _mark(self, path: str, root: str) -> None:
        """``path`` and each directory between it and ``root`` are the worker's (the lock held)."""
        while _under(path, root) and path != root and len(self._own) < MAX_OWN:
            self._own.add(path)
            path = os.path.dirname(path)

    def _watch_pending(self) -> None:
        with self._lock:
            appeared = [p for p in self.pending if p.is_dir()]
            self.pending = [p for p in self.pending if p not in appeared]
            self.roots += appeared
        if not appeared or self._observer is None:
            return
        for path in appeared:
            try:
                self._observer.schedule(self._handler, str(path), recursive=True)
            except OSError:
                continue
            for n, (dirpath, dirnames, filenames) in enumerate(os.walk(path)):  # written before the watch
                if n >= MAX_FOUND:
                    break
                for name in dirnames:
                    self.saw(os.path.join(dirpath, name), True)
                for name in filenames:
                    self.saw(os.path.join(dirpath, name), False)


_V = TypeVar("_V")


def _newest(kept: dict[str, _V], key: str, value: _V) -> None:
    """Keep ``key`` as the newest entry of ``kept``, the oldest dropped past ``MAX_FOUND``."""
    kept.pop(key, None)
    kept[key] = value
    if len(kept) > MAX_FOUND:
        del kept[next(iter(kept))]


def _output_like(cwd: Path) -> list[Path]:
    """Directories in ``cwd`` named like a script's output (``out``, ``checkpoints``, ``runs``)."""
    try:
        return [p for p in sorted(cwd.iterdir()) if p.is_dir() and not _hidden(p.name)
                and _OUTPUT_NAME.match(p.name)]
    except OSError:
        return []
