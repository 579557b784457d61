"""Finding the newest valid checkpoint among the files or directories the worker writes.

The newest is the one holding the highest step, where its step is known (``observe/ckptstep.py``:
the probe's save record, learned from the loop; HF's ``trainer_state.json``; a number its name labels
as a step, ``observe/ckptname.py``); else the highest epoch or save count its name gives; else the
newest modification time. A number the name does not label as a step (a batch size, a version, a
rank) never orders them. A checkpoint still being written is never
chosen: temp names are skipped, and while the worker runs a candidate must keep the same size and
mtime for ``settle`` seconds. The ``watchdog`` package tells us when something changed, so the
directory is rescanned only then (with a polling observer where inotify is unavailable).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from oomguard.supervisor.observe.ckptname import read_name
from oomguard.supervisor.observe.ckptstep import NAME, OWN_RECORD, StepEvidence, recorded_step

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
    step_from: str | None = None  # which evidence gave the step (observe/ckptstep.py); None if unknown

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
    """The step a checkpoint's name labels as one, if any (``observe/ckptname.py``)."""
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
