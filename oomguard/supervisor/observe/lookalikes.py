"""Files the worker writes that look like checkpoints: what a ``--checkpoint`` glob that matches nothing missed.

Tested in tests/unit/supervisor/run/test_preflight.py (the files that look like checkpoints).

A glob that matches nothing (``checkpoints/*.pt`` while the script writes ``out/step-N.pt``) used to
throw a night's progress away in silence: every restart started over. ``LookalikeWatcher`` watches
the worker's working directory, and the output directories its
command names (``--output_dir out``, ``--save-dir=/scratch/run``) or it creates, for what the worker
writes that looks like a checkpoint: a ``.pt``, ``.pth``, ``.ckpt`` or ``.safetensors`` file, a
``checkpoint-N/`` directory, a name with ``step`` and a number (``step_100/``, ``global_step100/``).
Names being written (``.checkpoint-4.tmp``) and hidden directories are left out. This is the
process's evidence (files it wrote), not its words.

Only the worker's own writes count: anything may write under the working directory while the run
goes (a ``cp`` of another experiment's ``best_model.pt`` from another shell, a ``pip install``), and
telling the user to point ``--checkpoint`` at such a file would resume another run's weights. A
look-alike is the worker's when the probe's ``save`` record names it (the path the worker's
``torch.save`` was given, or the temp name an atomic writer renamed to it, or a file inside it) or
when one of the worker's processes held it open for writing as its write was reported
(``held_for_writing`` below: the evidence where the probe does not speak). Any other is never named,
and the notice below that says nothing was written does not say so while one was.

``missed_notice`` and ``unmatched_notice`` say when to tell the user, once, and what:

- the worker wrote a look-alike no glob matches, in a directory no glob looks in: said as soon as
  it is seen (the glob is a matter of names: the file need not be finished for the index to miss
  it), while the attempt that wrote it still runs, not after the restart that would have resumed
  from it. The notice names the files and the glob they suggest (digits in the name become ``*``);
- one beside the files a glob watches (nanochat's ``optim_N.pt`` next to ``model_N.pt``) is a part
  of a checkpoint once the globs match something; while they match nothing it is said once it has
  been still for ``SETTLE`` seconds and the script showed a later step (the index, which counts a
  file still for a second, would have matched it by then if it could);
- or nothing like a checkpoint was written, yet the globs have matched nothing through
  ``QUIET_LIMIT`` seconds (30 min) of training. Most scripts save more often than that (Hugging
  Face's default 500 steps, nanoGPT's 2000 iterations are minutes); a restart now would lose all
  of it, so even a script that saves rarely is better told once than not at all.

Also here:

- Which files the worker's processes hold open for writing: the kernel's word that the worker wrote one.
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from oomguard.supervisor.observe.checkpoints import is_temp_name, quiet_stop_race, renamed_name

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
    """``rel`` (relative to a watched directory) as an atomic writer renames it into place: a temp
    name of the file or of its directory replaced by the name without its temp marks
    (``out/.step-4.pt.tmp`` -> ``out/step-4.pt``, ``out/.step_4.tmp/model.pt`` -> ``out/step_4/model.pt``),
    as ``observe/progress.py``'s ``Save`` maps a save record to the checkpoint the index finds. A name
    only hidden (``.cache``) is no temp name here: its file is not renamed to another's."""
    parts = rel.split(os.sep)
    tail = [(renamed_name(part) if is_temp_name(part.lstrip(".")) else None) or part for part in parts[-2:]]
    return os.sep.join([*parts[:-2], *tail])


def suggest_glob(paths: Sequence[str], cwd: Path) -> str:
    """The glob most of ``paths`` fit, digits made ``*``: ``out/step-2.pt`` -> ``out/step-*.pt``;
    relative to ``cwd`` where they lie under it."""
    patterns: Counter[str] = Counter()
    for path in paths:
        rel = os.path.relpath(path, cwd)
        shown = path if rel.startswith("..") else rel
        head, name = os.path.split(shown)
        patterns[os.path.join(head, re.sub(r"\d+", "*", name))] += 1
    return patterns.most_common(1)[0][0]


def output_dirs(command: Sequence[str], cwd: Path) -> list[Path]:
    """The directories the command's output options name (``--output_dir out``, ``--save-dir=x``),
    absolute, whether or not they exist yet."""
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
        path = Path(value) if os.path.isabs(value) else cwd / value
        found.append(path.parent if path.suffix.lower() in SUFFIXES else path)
    return found


def matched(path: str, globs: Sequence[str], cwd: Path) -> bool:
    """Does one of the ``--checkpoint`` globs match ``path`` (a look-alike), or a directory above it?
    fnmatch's ``*`` also crosses ``/``: a doubt is read as a match, never as a false alarm."""
    patterns = [g if os.path.isabs(g) else str(cwd / g) for g in globs]
    candidates = [path, *(str(p) for p in Path(path).parents)]
    return any(fnmatch.fnmatchcase(c, os.path.normpath(p)) for p in patterns for c in candidates)


def beside(path: str, globs: Sequence[str], cwd: Path) -> bool:
    """Is ``path`` in a directory one of the globs looks in?"""
    patterns = [g if os.path.isabs(g) else str(cwd / g) for g in globs]
    return any(fnmatch.fnmatchcase(os.path.dirname(path), os.path.dirname(os.path.normpath(p))) for p in patterns)


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
    checkpoint, or None while it is too early (see the module). With ``others``, files that look like
    one were written there, but not seen written by the script."""
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
        if event.event_type in _WRITES:
            path = event.dest_path if event.event_type == "moved" else event.src_path
            if event.event_type == "moved":
                self.watcher.moved(os.fsdecode(event.src_path), os.fsdecode(path))
            created = event.event_type in ("created", "moved")
            writing = event.event_type in ("created", "modified")  # closed: no process holds it any more
            self.watcher.saw(os.fsdecode(path), event.is_directory, created, writing)


class LookalikeWatcher:
    """Look-alikes the worker writes in ``cwd`` and its output directories.

    Each watched path costs an inotify instance and a thread (watchdog's emitter), and a recursive
    watch one kernel watch per directory below it, so the working tree (a virtualenv, a dataset of
    many directories) is not watched whole: ``cwd`` itself without recursion, and recursively the
    output directories the command names, the directories in ``cwd`` named like outputs (``out``,
    ``checkpoints``, ``runs``...) and every directory the worker creates in ``cwd`` while it runs
    (new, so watched; whose files they hold is still proven file by file). Where inotify cannot be had
    nothing is watched, and the notice waits for ``QUIET_LIMIT`` with no names: polling a whole tree
    every second would cost more than it is worth.

    ``pids`` gives the worker's processes (the loop's last sample of its tree): a write reported
    while one of them holds the file open for writing is the worker's; ``saved`` takes the paths
    of the probe's ``save`` records. Each look-alike found says whether it is the worker's.
    """

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
        """Watch ``path`` recursively: from the start when it exists, else (or ``later``) once the
        loop's next look finds it."""
        known = [*self.roots, *self.pending]
        if path == self.cwd or any(path.is_relative_to(r) for r in known) or len(known) >= MAX_ROOTS:
            return
        if any(_under(str(path), ignored) for ignored in self.ignore):
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
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None

    def saw(self, path: str, is_dir: bool, created: bool = False, writing: bool = False) -> None:
        """A write (on watchdog's thread): kept when it belongs to a look-alike; with ``writing`` (the
        write itself, not a rename or a walk of what was there) the worker's when one of its
        processes holds the file open for writing. A directory created in ``cwd`` is watched from
        the next look on."""
        if any(_under(path, ignored) for ignored in self.ignore):
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
            self._found.pop(found, None)
            self._found[found] = time.time()
            if len(self._found) > MAX_FOUND:
                del self._found[next(iter(self._found))]

    def found(self) -> list[Lookalike]:
        """The look-alikes written so far, each saying whether the worker wrote it (the loop's
        thread; pending directories that now exist are watched from here on, and what they
        already hold is looked at once)."""
        self._watch_pending()
        with self._lock:
            return [Lookalike(p, t, p in self._own) for p, t in self._found.items()]

    def saved(self, paths: Iterable[str]) -> None:
        """The files the probe's ``save`` records say the worker's ``torch.save`` wrote."""
        for path in paths:
            root = self._root_of(path, [*self.roots, *self.pending])  # a save may create its directory
            if root is not None:
                self._wrote(path, root)

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
            self._looked.pop(path, None)
            self._looked[path] = now
            if len(self._looked) > MAX_FOUND:
                del self._looked[next(iter(self._looked))]
        pids = tuple(self.pids())
        if pids and held_for_writing(pids, {os.path.realpath(path)}):
            self._wrote(path, root)

    def moved(self, src: str, dest: str) -> None:
        """A rename (on watchdog's thread): what the worker wrote stays its under the new name,
        whether its evidence came first or comes later (a save record arrives after the rename)."""
        root = self._root_of(dest)
        if root is None or any(_under(dest, ignored) for ignored in self.ignore):
            return
        with self._lock:
            self._moves.pop(src, None)
            self._moves[src] = dest
            if len(self._moves) > MAX_FOUND:
                del self._moves[next(iter(self._moves))]
            if src in self._own:
                self._mark(dest, root)

    def _wrote(self, path: str, root: str) -> None:
        """The worker wrote ``path`` (under ``root``): it, under the name a rename seen gave it or
        its directory (else the name an atomic writer's temp name is renamed to), and each
        directory between it and ``root`` are the worker's (a look-alike may be a directory)."""
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
            for path in appeared:
                self.pending.remove(path)
                self.roots.append(path)
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


def _output_like(cwd: Path) -> list[Path]:
    """Directories in ``cwd`` named like a script's output (``out``, ``checkpoints``, ``runs``)."""
    try:
        return [p for p in sorted(cwd.iterdir()) if p.is_dir() and not _hidden(p.name)
                and _OUTPUT_NAME.match(p.name)]
    except OSError:
        return []
