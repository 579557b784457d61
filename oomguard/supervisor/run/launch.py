"""The worker's launcher: a tiny stdlib-only parent between the supervisor and the training command.

Tested in tests/e2e/test_supervisor.py and tests/e2e/test_spare_budget.py (the oom_score_adj it sets).

Run as ``python -I -S launch.py SUPERVISOR_PID OOM_SCORE_ADJ CGROUP_PROCS -- COMMAND...`` in a new
session. No worker outlives the supervisor: the kernel sends it SIGTERM when the supervisor dies
(PR_SET_PDEATHSIG, even after SIGKILL) and it kills the whole process group, the descendants and the
worker's cgroup (a grandchild that called setsid() is in no group of ours). It joins that cgroup and
raises ``oom_score_adj`` first, and ends as its child ended, so classification sees the real status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
# Signals meant for the worker reach the whole group; the launcher only has to survive them.
_PASS_THROUGH = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as exc:  # not root, no cgroup: the supervisor falls back to watching RSS
        print(f"oomguard-launch: cannot write {path}: {exc.strerror}", file=sys.stderr)


def _kill_descendants() -> None:
    """SIGKILL what a killpg misses where there is no cgroup: torchrun starts each rank in a session
    of its own, so the ranks are found as our descendants (/proc)."""
    me = os.getpid()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    doomed, frontier = set(), [me]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in doomed]
        doomed.update(children)
        frontier += children
    for pid in doomed - {me}:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def _kill_cgroup(cgroup_procs: str) -> None:
    """Kill every process in the worker's cgroup: a grandchild that called setsid() left our process
    group, but not the cgroup. cgroup v2 does it atomically (cgroup.kill); v1 is a loop over
    cgroup.procs, repeated while something forks."""
    if cgroup_procs == "-":
        return
    kill_file = os.path.join(os.path.dirname(cgroup_procs), "cgroup.kill")
    if os.path.exists(kill_file):
        _write(kill_file, "1")
        return
    me = os.getpid()
    for _ in range(10):
        try:
            with open(cgroup_procs) as fh:
                others = [int(p) for p in fh.read().split() if int(p) != me]
        except OSError:
            return
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def main(argv: list[str]) -> None:
    supervisor_pid, adj, cgroup_procs = int(argv[1]), argv[2], argv[3]
    command = argv[argv.index("--") + 1:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor_pid:  # it died before prctl took effect
        os.killpg(0, signal.SIGKILL)

    def on_term(signum: int, frame: object) -> None:
        if os.getppid() != supervisor_pid:  # orphaned: take the cgroup, the descendants and the group down
            _kill_cgroup(cgroup_procs)
            _kill_descendants()
            os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_term)
    for sig in _PASS_THROUGH:
        signal.signal(sig, lambda signum, frame: None)  # a handler, not SIG_IGN: exec resets it
    if adj != "-":
        _write("/proc/self/oom_score_adj", adj)
    if cgroup_procs != "-":
        _write(cgroup_procs, str(os.getpid()))
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"oomguard: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        os._exit(127)
    _, status = os.waitpid(child.pid, 0)
    if os.WIFSIGNALED(status):
        code = os.WTERMSIG(status)
        if code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot have handlers anyway
            signal.signal(code, signal.SIG_DFL)
        os.kill(os.getpid(), code)
        os._exit(128 + code)  # a signal whose default is to be ignored
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv)
