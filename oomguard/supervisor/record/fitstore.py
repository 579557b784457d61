"""Remembering what fits across runs, so a new run of the same job starts at a size that worked.

Records are keyed by a fingerprint of what decides whether a micro-batch fits: the training command
with the paths the run writes to taken out (a new output directory is the same job), the content of
the files it names (the script, its configs: ``cfg=model.yaml``), the GPU model and memory, the
world size and, without a GPU, the memory limit. Not the per-process batch: memory depends on the
micro-batch alone. A record also keeps the models it was measured with (``ModelPrint``, the probe's
digest of the optimizer's parameters): what the key cannot see (an imported ``model.py`` edited, a
hub model changed) the probe can, and a run that finds another model replaces the record.

A record also keeps the models it was measured with (``ModelPrint``: the digest the probe takes of
the optimizer's parameters at a process's first step, probe/steps.py): what the key cannot see (an
imported ``model.py`` edited, a config opened by a fixed path, a hub model changed upstream) the
probe can, and a run that finds another model replaces the record (``SizeTuner.model_seen``).

The store is one SQLite database in WAL mode with ``synchronous=FULL`` in a cache directory
(``OOMGUARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/oomguard``, else ``~/.cache/oomguard``): a crash
mid-write leaves the previous record, and two supervisors can write at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from oomguard.supervisor.sizing.memmodel import FitRecord, Key, ModelPrint, Point, merge_models, merge_point
from oomguard.supervisor.units import format_size

_SCHEMA = """
CREATE TABLE IF NOT EXISTS fits (
    fingerprint TEXT PRIMARY KEY,
    description TEXT NOT NULL,
    micro_batch INTEGER,
    failed_micro INTEGER,
    points TEXT NOT NULL,
    updated_wall REAL NOT NULL
)
"""
# The models a record was measured with, beside it rather than in a new column of ``fits``: an older
# oomguard writes ``fits`` with ``INSERT ... VALUES`` of six values, which a seventh column would
# break, so an older and a newer oomguard can share one cache directory. A record without a row
# here (made before, or by runs without the probe) was measured with a model nobody saw.
_MODELS_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    fingerprint TEXT PRIMARY KEY,
    models TEXT NOT NULL
)
"""
_SELECT = ("SELECT f.fingerprint, f.description, f.micro_batch, f.failed_micro, f.points, f.updated_wall, m.models"
           " FROM fits AS f LEFT JOIN models AS m ON m.fingerprint = f.fingerprint WHERE f.fingerprint = ?")


def default_cache_dir() -> Path:
    """Where the fit store lives unless the caller says otherwise."""
    if explicit := os.environ.get("OOMGUARD_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "oomguard"


OUTPUT = "{output}"  # stands for a path the run writes to, in a key's command
_HASHED_MAX = 4 * 2**20  # files the command names are fingerprinted by content up to this size
# Files whose content is the job (code, configs); any other file may be one the script writes.
_JOB_SUFFIXES = (".py", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".json")


@dataclass(frozen=True)
class JobKey:
    """What decides whether a micro-batch fits. ``gpus``: (model name, total bytes) per device;
    ``limit``: the memory limit in bytes a run without a GPU fits under; ``files``: a digest of
    each file the command names (the script, its configs)."""

    command: tuple[str, ...]
    gpus: tuple[tuple[str, int], ...]
    world_size: int
    limit: int | None = None
    files: tuple[str, ...] = ()

    @classmethod
    def for_run(cls, command: Sequence[str], cwd: Path, writes: Sequence[Path], gpus: tuple[tuple[str, int], ...],
                world_size: int, limit: int | None) -> JobKey:
        """The key of a run: ``writes`` are the directories it writes to (checkpoints, run directory),
        which name the run rather than the job."""
        here = cwd.resolve()  # a "place" that holds the working directory would swallow the script too
        places = [w for w in (w.resolve() for w in writes) if w != here and w not in here.parents]
        tokens, files = [], []
        for token in command:
            written = _output_form(token, cwd, places)
            if written is None:
                written = token
                if (path := _job_file(token, cwd)) is not None:
                    files.append(_digest(path))
            tokens.append(written)
        return cls(tuple(tokens), gpus, world_size, None if gpus else limit, tuple(files))

    @property
    def fingerprint(self) -> str:
        parts: list[object] = [list(self.command), [list(g) for g in self.gpus], self.world_size]
        if self.limit is not None or self.files:  # keys made before these fields keep their fingerprint
            parts += [self.limit, list(self.files)]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]

    def describe(self) -> str:
        gpus = ", ".join(f"{name} {format_size(total)}" for name, total in self.gpus) or "no GPU"
        limit = f" | limit {format_size(self.limit)}" if self.limit else ""
        return f"{' '.join(self.command)[:200]} | {gpus}{limit} | world {self.world_size}"


def _output_form(token: str, cwd: Path, places: Sequence[Path]) -> str | None:
    """``token`` with the path in it that lies in a place the run writes made ``{output}``, or None.

    The path is the whole token or what follows one of its ``=``, the first that lies in a place (a
    flag is no path): ``runs/x``, ``--log=runs/x/bs{micro_batch}.txt``, Hydra's ``hydra.run.dir=runs/x``,
    mmdetection's ``--cfg-options=work_dir=runs/x``. ``lr=3e-4`` is ``cwd/3e-4``, in no place."""
    for cut in [0, *(i + 1 for i, c in enumerate(token) if c == "=")]:
        path = _as_path(token[cut:], cwd)
        if path is not None and any(path == w or w in path.parents for w in places):
            return token[:cut] + OUTPUT
    return None


def _job_file(token: str, cwd: Path) -> Path | None:
    """The job file (script, config: ``_JOB_SUFFIXES``, existing) a token names, or None: the whole
    token, else what follows its last ``=`` (a flag's value, ``--config=model.yaml``, or an
    override's, Hydra's or YOLO's ``cfg=model.yaml``)."""
    candidates = [token] if not token.startswith("-") else []
    if "=" in token:
        candidates.append(token.rpartition("=")[2])
    for value in candidates:
        path = _as_path(value, cwd)
        # os.path.isfile, not Path.is_file: a name too long for the kernel (ENAMETOOLONG) is no file, not an error
        if path is not None and path.suffix in _JOB_SUFFIXES and os.path.isfile(path):
            return path
    return None


def _as_path(value: str, cwd: Path) -> Path | None:
    """``value`` read as a path (existing or not: an output directory the first run has not made
    yet must be taken out of the key as the second run's is; placeholders in it are part of its
    name); None for a flag."""
    if not value or value.startswith("-"):
        return None
    path = Path(value) if os.path.isabs(value) else cwd / value
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return None


def _digest(path: Path) -> str:
    """A file's content digest (name and size only past ``_HASHED_MAX``: an interpreter, a dataset)."""
    try:
        size = path.stat().st_size
        if size > _HASHED_MAX:
            return f"{path.name}:{size}"
        return f"{path.name}:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
    except OSError:
        return f"{path.name}:unreadable"


class FitStore:
    """The SQLite-backed store; each call opens and closes its own connection (no held locks)."""

    def __init__(self, directory: Path | str | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.path = self.directory / "fits.sqlite3"

    def load(self, key: Key) -> FitRecord | None:
        with self._connect() as db:
            row = db.execute(_SELECT, (key.fingerprint,)).fetchone()
        return _decode(row) if row else None

    def record(self, key: Key, point: Point, models: Sequence[ModelPrint] = ()) -> FitRecord:
        """Fold one attempt into the job's record, atomically, and return the new record. ``models``:
        what this run trains, where the probe said; a record measured with none of them is another
        model's and is replaced, not merged into."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")  # read-modify-write must not race another supervisor
            row = db.execute(_SELECT, (key.fingerprint,)).fetchone()
            base = _decode(row) if row else None
            if base is None or (models and base.models and not any(base.measured(m) for m in models)):
                base = FitRecord(key.fingerprint, key.describe(), None, None, (), 0.0)
            new = replace(merge_point(base, point, time.time()), models=merge_models(base.models, models))
            _write(db, new)
            db.execute("COMMIT")
        return new

    def rewrite(self, key: Key, points: Sequence[Point], models: Sequence[ModelPrint]) -> FitRecord:
        """Replace the job's record with ``points`` measured with ``models`` (a run that found the
        record was another model's: its own measurements, from the first, are the record now)."""
        now = time.time()
        new = FitRecord(key.fingerprint, key.describe(), None, None, (), now, tuple(models))
        for point in points:
            new = merge_point(new, point, now)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            _write(db, new)
            db.execute("COMMIT")
        return new

    def forget(self, key: Key) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM fits WHERE fingerprint = ?", (key.fingerprint,))
            db.execute("DELETE FROM models WHERE fingerprint = ?", (key.fingerprint,))

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.directory.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # WAL+NORMAL may drop the last commit on power loss
            db.execute(_SCHEMA)
            db.execute(_MODELS_SCHEMA)  # a store made before it gains the table on first open
            yield db
        finally:
            db.close()


def _write(db: sqlite3.Connection, record: FitRecord) -> None:
    db.execute("INSERT OR REPLACE INTO fits VALUES (?, ?, ?, ?, ?, ?)", (record.fingerprint, record.description,
               record.micro_batch, record.failed_micro,
               json.dumps([[p.micro_batch, p.peak_bytes, p.succeeded] for p in record.points]), record.updated_wall))
    if record.models:
        models = json.dumps([[m.digest, m.params, m.tensors] for m in record.models])
        db.execute("INSERT OR REPLACE INTO models VALUES (?, ?)", (record.fingerprint, models))
    else:  # measured with no model seen: no row, rather than one an older model's would outlive
        db.execute("DELETE FROM models WHERE fingerprint = ?", (record.fingerprint,))


def _decode(row: tuple[str, str, int | None, int | None, str, float, str | None]) -> FitRecord:
    fp, description, micro, failed, points, updated, models = row
    decoded = tuple(Point(int(m), None if peak is None else int(peak), bool(ok)) for m, peak, ok in json.loads(points))
    prints = tuple(ModelPrint(str(d), int(n), int(t)) for d, n, t in json.loads(models)) if models else ()
    return FitRecord(fp, description, micro, failed, decoded, updated, prints)
