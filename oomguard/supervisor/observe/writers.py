"""Which files the worker's processes hold open for writing: the kernel's word that the worker wrote one.

An inotify event says a file under the working directory was written, not by whom: a ``cp`` from
another shell, a ``pip install``, another experiment's job look the same. Where the probe speaks,
its ``save`` records name the files the worker's ``torch.save`` wrote; where it does not (a program
that is not Python, ``--no-probe``, a file written without ``torch.save``), the only sound evidence
short of privileged kernel interfaces (fanotify's writer pid needs CAP_SYS_ADMIN) is the open file
itself: ``/proc/<pid>/fd/<n>`` links to it and ``/proc/<pid>/fdinfo/<n>``'s ``flags`` carry
``O_WRONLY`` or ``O_RDWR`` while one of the worker's processes writes it.

The look is taken when inotify reports the write (within milliseconds: the file is created, then
written), so a file written and closed faster than that (a small ``torch.save``, a ``write_text``)
may not be seen here: a missing answer, never a wrong one. A large checkpoint, whose write takes
seconds, is. The processes asked are the worker's as last sampled (every ``--sample-interval``): one
it started since is not asked, and a process that is not the worker's never is.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable

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
