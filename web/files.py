"""Small file helpers for the web layer: an atomic, private write (the control token)."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600, atomically: a reader (``oomguard stop``) sees the
    old token or the new one, never half a file, and a crash leaves no partial token behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # ours from a crash (the name carries our pid); O_EXCL refuses anything else
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by umask; this is not
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
