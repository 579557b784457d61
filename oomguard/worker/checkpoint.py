"""Atomic directory checkpoints: complete or absent, never half-written.

Layout: ``<dir>/checkpoint-<step>/`` holding ``state.pt`` and the marker ``COMPLETE`` (JSON:
step, fingerprint, file sizes). A checkpoint is written into ``.checkpoint-<step>.tmp-<pid>``
(fsync every file, write the marker last, fsync the directory), renamed into place, and the
parent directory is fsynced. Old checkpoints are first renamed to ``.trash-*`` and only then
deleted, so a kill during pruning never leaves a directory that looks complete but is not.
A supervisor glob like ``checkpoint-*`` therefore only ever matches whole checkpoints.

Also here:

- Capturing and restoring every random stream a training step may draw from.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"
STATE_FILE = "state.pt"
PREFIX = "checkpoint-"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: incomplete, truncated, or for another configuration."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int


class CheckpointStore:
    """The checkpoints of one run in ``directory``: write, find the newest complete one, prune."""

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last

    def save(self, step: int, state: dict[str, Any], fingerprint: str) -> Path:
        """Write ``state`` as checkpoint ``step`` atomically and prune; returns its path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{PREFIX}{step}"
        tmp = self.directory / f".{PREFIX}{step}.tmp-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        size = _write_file(tmp / STATE_FILE, lambda f: torch.save(state, f))
        marker = {"step": step, "fingerprint": fingerprint, "files": {STATE_FILE: size}}
        _write_file(tmp / MARKER, lambda f: f.write(json.dumps(marker).encode()))
        _fsync_dir(tmp)
        if final.exists():  # same step saved again (e.g. a request right after a scheduled save)
            self._discard(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        self.prune()
        return final

    def complete(self) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [
            CheckpointInfo(p, int(m.group(1))) for p in self.directory.iterdir() if (m := _NAME.match(p.name))
        ]
        return sorted((c for c in found if is_complete(c.path)), key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        done = self.complete()
        return done[-1] if done else None

    def prune(self) -> None:
        for old in self.complete()[: -self.keep_last]:
            self._discard(old.path)
        self.clean_stale()

    def clean_stale(self) -> None:
        """Remove temp and trash directories left by a killed writer of this or an older process."""
        if not self.directory.is_dir():
            return
        mine = f"-{os.getpid()}-"
        for path in self.directory.iterdir():
            stale_tmp = path.name.startswith(f".{PREFIX}") and mine not in path.name
            if stale_tmp or path.name.startswith(".trash-"):
                shutil.rmtree(path, ignore_errors=True)

    def _discard(self, path: Path) -> None:
        trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def is_complete(path: Path) -> bool:
    try:
        _check(path)
    except CheckpointError:
        return False
    return True


def load(path: str | os.PathLike[str], fingerprint: str | None = None) -> dict[str, Any]:
    """The state saved in checkpoint ``path``; raises CheckpointError when it is not usable."""
    marker = _check(Path(path))
    if fingerprint is not None and marker["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was written by a different configuration "
            f"(fingerprint {marker['fingerprint'][:12]} != {fingerprint[:12]}); "
            "use the same global batch, world size, model and optimizer, or start a new run directory"
        )
    state: dict[str, Any] = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
    return state


def _check(path: Path) -> dict[str, Any]:
    try:
        marker: dict[str, Any] = json.loads((path / MARKER).read_text())
        sizes = {name: (path / name).stat().st_size for name in marker["files"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete ({exc})") from None
    if sizes != marker["files"]:
        raise CheckpointError(f"checkpoint {path} is truncated: sizes {sizes}, expected {marker['files']}")
    return marker


def _write_file(path: Path, write: Any) -> int:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_cpu_copy(obj: Any) -> Any:
    """A deep copy of a state tree with every tensor copied to the CPU.

    This is the snapshot an asynchronous save writes: training keeps mutating its tensors in
    place, so even CPU tensors must be copied before the background thread reads them.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu_copy(v) for v in obj)
    return obj


class AsyncWriter:
    """Writes one checkpoint at a time in a background thread; errors surface on the next call."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: list[tuple[Path, int]] = []

    def submit(self, step: int, snapshot: dict[str, Any], fingerprint: str) -> None:
        self.wait()
        self._thread = threading.Thread(
            target=self._run, args=(step, snapshot, fingerprint), name=f"oomguard-ckpt-{step}", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"asynchronous checkpoint write failed: {error}") from error

    def finished(self) -> list[tuple[Path, int]]:
        """Checkpoints written since the last call (path, step), for reporting from the main thread."""
        done, self._done = self._done, []
        return done

    def _run(self, step: int, snapshot: dict[str, Any], fingerprint: str) -> None:
        try:
            path = self.store.save(step, snapshot, fingerprint)
        except Exception as exc:  # kept for the main thread, which decides what a failure means
            self._error = exc
            return
        self._done.append((path, step))


# Capturing and restoring every random stream a training step may draw from.
#
# The state is kept in plain types and tensors so checkpoints load with ``weights_only=True``
# (no pickle of arbitrary objects): Python's ``random``, NumPy's legacy global generator, torch's
# CPU generator and the generator of every CUDA device.


try:
    import numpy as np
except ImportError:  # numpy is optional for the worker
    np = None  # type: ignore[assignment]


def capture() -> dict[str, Any]:
    """A snapshot of all random streams, safe to ``torch.save``."""
    state: dict[str, Any] = {"python": _python_state(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = _numpy_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put every random stream back where ``capture`` found it."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        _restore_numpy(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_state() -> tuple[int, list[int], float | None]:
    version, internal, gauss = random.getstate()
    return version, list(internal), gauss


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "name": str(name),
        "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _restore_numpy(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))
