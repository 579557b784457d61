"""The CUDA allocator's own snapshot at an OOM, for the attempt after a CUDA OOM, per rank.

Recording the allocator's history (``torch.cuda.memory._record_memory_history``) keeps a Python
stack for every allocation: it costs time on every allocation, so the probe records only in the
attempt that follows one that met a CUDA OOM. That attempt's OOM then saves the snapshot
(``torch.cuda.memory._snapshot()``, pickled as ``_dump_snapshot`` does: the file
https://pytorch.org/memory_viz opens) as ``memory/snapshot-attempt<N>-rank<R>.pickle`` in the run
directory, and its ``memory`` record names the largest allocations alive by the program's own frame
that made them. The first OOM only leaves ``memory/cuda-oom-attempt`` (its attempt number) behind.

``OOMGUARD_MEMORY_SNAPSHOT=off`` in oomguard's environment (the worker inherits it) turns it off.
Nothing here initializes CUDA: recording starts at CUDA's own lazy initialization.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

from ..common import protocol
from . import channel

ENV_SWITCH = "OOMGUARD_MEMORY_SNAPSHOT"
MARKER = "cuda-oom-attempt"
MAX_ENTRIES = 100_000  # allocation events kept: the memory viewer's default scale, a few MB of host memory
TOP = 5


def _off() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "no", "false")


def _folder() -> str | None:
    run_dir = os.environ.get(protocol.ENV_RUN_DIR)
    return os.path.join(run_dir, "memory") if run_dir else None


def armed(folder: str | None, attempt: int | None) -> bool:
    """Whether this attempt follows one that met a CUDA OOM (its marker names attempt - 1)."""
    if folder is None or attempt is None or _off():
        return False
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return int(f.read().strip() or -1) == attempt - 1
    except (OSError, ValueError):
        return False


def where(frames: list[dict[str, Any]]) -> str | None:
    """The program's own frame that made an allocation: the innermost one outside torch."""
    for frame in frames:
        name = str(frame.get("filename", ""))
        if name and not name.startswith("<") and f"{os.sep}torch{os.sep}" not in name:
            return f"{name}:{frame.get('line')} in {frame.get('name')}"
    return None


def largest(snapshot: dict[str, Any], top: int = TOP) -> list[dict[str, Any]]:
    """The allocations alive in ``snapshot``, summed by the program's frame that made them, largest first."""
    sums: dict[str, list[int]] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            key = where(block.get("frames") or []) or "no Python frame recorded"
            entry = sums.setdefault(key, [0, 0])
            entry[0] += int(block.get("requested_size") or block.get("size") or 0)
            entry[1] += 1
    ranked = sorted(sums.items(), key=lambda item: -item[1][0])[:top]
    return [{"where": key, "bytes": size, "allocations": count} for key, (size, count) in ranked]


class Snapshots:
    """What a CUDA OOM adds to its ``memory`` record (``at_oom``), and the recording behind it."""

    def __init__(self, torch: Any, folder: str | None, attempt: int | None) -> None:
        self._torch, self.folder, self.attempt = torch, folder, attempt
        self.recording = False

    def start(self) -> None:
        """At CUDA's lazy initialization: record the history (Python stacks only: the cheaper kind)."""
        try:
            self._torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
            self.recording = True
        except Exception as exc:
            channel.failed(f"allocator history not recorded: {type(exc).__name__}: {exc}")

    def at_oom(self, index: int) -> dict[str, Any]:
        if self.folder is None or _off():
            return {}
        os.makedirs(self.folder, exist_ok=True)
        if not self.recording:
            _write(os.path.join(self.folder, MARKER), f"{self.attempt}\n".encode())
            return {"snapshot": None}
        snapshot = self._torch.cuda.memory._snapshot()
        rank = channel.env_int("RANK") or 0
        path = os.path.join(self.folder, f"snapshot-attempt{self.attempt}-rank{rank}.pickle")
        _write(path, pickle.dumps(snapshot))
        return {"snapshot": path, "stacks": largest(snapshot)}


def _write(path: str, data: bytes) -> None:
    """Atomically: a reader never opens half a pickle."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def install(torch: Any) -> Callable[[int], dict[str, Any]]:
    """Record the history from CUDA's initialization where this attempt follows a CUDA OOM; returns
    what an OOM adds to its record."""
    snapshots = Snapshots(torch, _folder(), channel.env_int(protocol.ENV_ATTEMPT))
    if armed(snapshots.folder, snapshots.attempt):
        torch.cuda._lazy_call(snapshots.start)
    return snapshots.at_oom
