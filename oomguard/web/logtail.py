"""The tail of an attempt's log, found by attempt number only.

Tested in tests/e2e/web/test_web_server.py and tests/e2e/web/test_web_fuzz.py.

The client never names a path: the file is ``run_dir/logs/attempt-N.log`` for a validated integer
N, and the resolved path must still lie inside ``run_dir/logs`` (a symlinked log is refused).
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_BYTES = 512 * 1024  # never read more than this from the end, however long the log


def log_path(run_dir: Path, attempt: int) -> Path | None:
    logs = (run_dir / "logs").resolve()
    path = (logs / f"attempt-{int(attempt)}.log").resolve()
    if path.parent != logs or not path.is_file() or path.stat().st_nlink > 1:
        return None  # a hard link in logs/ may name any file of the machine: never served
    return path


def tail(path: Path, lines: int, max_bytes: int = MAX_BYTES) -> tuple[list[str], int, bool]:
    """The last ``lines`` lines (at most ``max_bytes`` read), the file size, and whether cut."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        start = max(0, size - max_bytes)
        fh.seek(start)
        text = fh.read(max_bytes).decode("utf-8", errors="replace")
    parts = text.splitlines()
    if start > 0 and parts:
        parts = parts[1:]  # the first line read is probably a partial one
    return parts[-lines:], size, start > 0 or len(parts) > lines
