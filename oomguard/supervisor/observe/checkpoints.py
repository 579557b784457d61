"""Finding the newest valid checkpoint among the files or directories the worker writes.

The newest is the one holding the highest step, where its step is known (``resolve`` below:
the probe's save record, learned from the loop; HF's ``trainer_state.json``; a number its name labels
as a step, ``read_name``); else the highest epoch or save count its name gives; else the
newest modification time. A number the name does not label as a step (a batch size, a version, a
rank) never orders them. A checkpoint still being written is never
chosen: temp names are skipped, and while the worker runs a candidate must keep the same size and
mtime for ``settle`` seconds. The ``watchdog`` package tells us when something changed, so the
directory is rescanned only then (with a polling observer where inotify is unavailable).

Also here:

- What a checkpoint's name says about its step: only a number the name labels as a step.
- The step a checkpoint holds, from the best evidence there is, and which evidence that was.
- Did the attempt start where it was told to? Its first step against the checkpoint's step.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

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
)
_SAVE_COUNT = re.compile(r"^checkpoint_(?P<n>\d+)$")  # accelerate automatic_checkpoint_naming: its save count
_FAIRSEQ_UPDATES = re.compile(r"^checkpoint_(?P<epoch>\d+)_(?P<updates>\d+)\.pt$")  # checkpoint_{epoch}_{updates}.pt


@dataclass(frozen=True)
class NameReading:
    """What a name says: the step (None when it says none) and a number that orders the checkpoints
    of its scheme without being a step (an epoch, a save count)."""

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
    numbers = _numbers(_EXTENSIONS.sub("", name))
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
    if m := _SAVE_COUNT.match(name):
        return NameReading(None, int(m["n"]))
    if m := _FAIRSEQ_UPDATES.match(name):
        return NameReading(int(m["updates"]), int(m["epoch"]))
    return None


def _numbers(stem: str) -> list[_Number]:
    return [_Number((m["label"] or "").lower(), m["sep"], m["num"])
            for m in _NUMBER.finditer(stem)]


def _the_checkpoints_own(number: _Number) -> bool:
    """A name's only number counts as its step when nothing but the checkpoint's noun names it (a
    ``-``, ``_`` or nothing before it), or a word of the user's own set apart by ``-`` or ``_``
    (``ck-100``); a number glued to another word (``r16``, ``gpt2``), given with ``=`` (a metric's
    form) or after a word that names something else (``bs-32``, ``rank_0``) is that word's."""
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
    """The name a writer renames the temp ``name`` to once it is complete (``ckpt.pt.tmp``,
    ``.step_2.pt.tmp``, ``.step_4.tmp``, ``tmp-checkpoint-6``: the name without its temp marks), or
    None where ``name`` is no temp name or nothing is left of it."""
    if not is_temp_name(name):
        return None
    final = _TEMP_TAIL.sub("", _TEMP_HEAD.sub("", name, count=1), count=1)
    return final if final and final != name else None


class _StopRace(logging.Filter):
    """watchdog 7's inotify emitter logs an error when an event arrives while it is being stopped
    (``InotifyEmitter.queue_events() called when the thread is inactive``): a race inside its
    ``stop()`` that loses nothing we read (the line was added in watchdog's PR #963), printed on the
    user's terminal after the run ended."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


def quiet_stop_race() -> None:
    """Filter the stop race out of watchdog's inotify logger (once, whoever starts an observer)."""
    logger = logging.getLogger("watchdog.observers.inotify")
    if not any(isinstance(f, _StopRace) for f in logger.filters):
        logger.addFilter(_StopRace())


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
            if _TEMP.search(Path(path).name) or (stat := _stat(path)) is None:
                continue
            path = os.path.abspath(path)
            known = learned.get(path) if learned else None
            step = known[1] if known is not None and known[0] == stat[0] else own_step(path)
            found[path] = Checkpoint(path, step.step, *stat, read_name(Path(path).name).ordinal, step.source)
    return sorted(found.values(), key=_newness, reverse=True)


def _newness(c: Checkpoint) -> tuple[int, int, float]:
    """A known step first (any step outranks none), then an epoch or save count, then the mtime."""
    return (c.step if c.step is not None else -1, c.ordinal if c.ordinal is not None else -1, c.mtime)


class _Dirty(FileSystemEventHandler):
    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.flag.set()


def _watch_roots(patterns: Iterable[str], cwd: Path) -> set[str]:
    """The deepest existing directory above each glob's first wildcard."""
    roots = set()
    for pattern in patterns:
        full = Path(pattern if os.path.isabs(pattern) else cwd / pattern)
        parts = []
        for part in full.parts:
            if glob.has_magic(part):
                break
            parts.append(part)
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
        """The directories the checkpoints are written in: each glob's path above its first
        wildcard (its parent when the last part is the wildcard's), never the working directory or
        one above it (a glob like ``ckpt-*`` in the working directory names no directory of its own)."""
        roots = []
        for pattern in self.patterns:
            full = Path(pattern if os.path.isabs(pattern) else self.cwd / pattern)
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
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
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
        if worker_alive:
            candidates = self.settled(exclude)
        else:
            candidates = [c for c in self.refresh(force=True) if c.path not in exclude]
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
    """Fed every step an attempt shows (the output thread and the loop both feed it); the verdict
    is taken from the first one that counts."""

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
