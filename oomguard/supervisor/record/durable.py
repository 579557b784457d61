"""One way to write a small file that must survive ``kill -9`` and never be read half-written.

The unit files, the control token, the per-attempt copies of ``--edit`` config files and the
checkpoint request all go through ``write_atomic``: a fresh temporary file in the same directory
(``mkstemp``: O_EXCL, so a planted symlink is never followed), fsynced, renamed over the target,
and the directory fsynced so the rename itself survives a crash. A reader sees the old content or
the new, never a mix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to ``path`` atomically with ``mode`` (not masked by the umask); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), mode)  # before the content: a 0600 secret is never readable by others
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
