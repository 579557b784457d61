"""Starting, watching and stopping one worker: every OS call for the worker is behind this class.

Tested in tests/e2e/test_operator.py and tests/e2e/faults/test_output.py.

The worker runs under ``launch.py`` in a session of its own, so one ``killpg`` reaches the whole
tree. Its merged stdout/stderr is drained in chunks as it streams (``pump.OutputPump``), passed to the
console untouched, appended to the attempt's log file and cut into lines for the loop's line callback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from oomguard.supervisor.observe.ranks import process_rank
from oomguard.supervisor.record.attemptlog import AttemptLog, open_log
from oomguard.supervisor.record.degraded import Degradations
from oomguard.supervisor.run.pump import OutputPump

LAUNCHER = str(Path(__file__).with_name("launch.py"))
WORKER_OOM_SCORE_ADJ = 500  # above the supervisor's, so the kernel picks the worker, not us


def worker_oom_score_adj() -> int:
    """The worker's OOM score: ours plus WORKER_OOM_SCORE_ADJ."""
    try:
        own = int(Path("/proc/self/oom_score_adj").read_text())
    except (OSError, ValueError):
        own = 0
    return min(1000, own + WORKER_OOM_SCORE_ADJ)


class WorkerProcess:
    """One attempt's worker process group."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path,
                 on_line: Callable[[str], None], echo: Callable[[bytes], None] | None,
                 cgroup_procs: Path | None = None, *, log_max_bytes: int | None = None,
                 problems: Degradations | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.cwd = cwd
        self.log_path = log_path
        self.on_line = on_line
        self.echo = echo
        self.cgroup_procs = cgroup_procs
        self.log_max_bytes = log_max_bytes
        self.problems = problems
        self.exited = threading.Event()
        self.exited_at: float | None = None  # monotonic: when the worker's exit was seen
        self.returncode: int | None = None
        self._started = time.monotonic()
        self._pump: OutputPump | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._worker_pid: int | None = None
        self._named: dict[str, object] = {}

    @property
    def last_output(self) -> float:
        """When the worker last wrote anything (a \r progress redraw included)."""
        return self._pump.last_output if self._pump is not None else self._started

    @property
    def pgid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self, wake: threading.Event, spare: subprocess.Popen[bytes] | None = None) -> None:
        """Start the worker under its launcher, or watch ``spare``: a spare interpreter (its
        launcher) just handed this attempt (``run/spare.py``)."""
        launch = [sys.executable, "-I", "-S", LAUNCHER, str(os.getpid()), str(worker_oom_score_adj()),
                  str(self.cgroup_procs) if self.cgroup_procs else "-", "--", *self.argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._proc = spare or subprocess.Popen(launch, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, cwd=self.cwd, env=self.env,
                                               start_new_session=True)
        self._started = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="worker-output", daemon=True)
        self._reader.start()
        threading.Thread(target=self._wait, args=(wake,), name="worker-wait", daemon=True).start()

    def _wait(self, wake: threading.Event) -> None:
        assert self._proc is not None
        self.returncode = self._proc.wait()
        self.exited_at = time.monotonic()
        self.exited.set()
        wake.set()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        log = AttemptLog(self.log_path, self.log_max_bytes, self.problems)
        self._pump = OutputPump(self._proc.stdout.fileno(), log, self.echo, self.on_line, self.problems)
        self._pump.run()

    @property
    def worker_pid(self) -> int | None:
        """The training command's pid (the launcher's child), once it exists."""
        if self._worker_pid is None and self._proc is not None:
            try:
                children = psutil.Process(self._proc.pid).children()
                self._worker_pid = children[0].pid if children else None
            except psutil.Error:
                return None
        return self._worker_pid

    def rank_pids(self) -> dict[int, int]:
        """Under torchrun or accelerate, each rank's training process (the topmost process of the tree
        with that ``RANK``: its DataLoader workers inherit the variable), by rank."""
        ranks: dict[int, int] = {}
        for proc in self.tree():
            rank = process_rank(proc.pid)
            if rank is None or rank in ranks:
                continue
            try:
                parent = proc.ppid()
            except psutil.Error:
                continue
            if process_rank(parent) != rank:
                ranks[rank] = proc.pid
        return dict(sorted(ranks.items()))

    def named_pids(self) -> dict[str, object] | None:
        """What status names: the training process (not ``launch.py``) and each rank's pid; only
        when it changed since the last call (it is written to the journal)."""
        named: dict[str, object] = {"worker_pid": _through_shells(self.worker_pid),
                                    "rank_pids": {str(r): p for r, p in self.rank_pids().items()}}
        if named == self._named or named["worker_pid"] is None:
            return None
        self._named = named
        return named

    def tree(self) -> list[psutil.Process]:
        """The worker's process tree (launcher excluded: its memory is the supervisor's cost)."""
        try:
            return psutil.Process(self.pgid).children(recursive=True)
        except psutil.Error:
            return []

    def signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def stop(self, grace: float, interrupted: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM the group, wait up to ``grace`` seconds, then SIGKILL; ``interrupted`` cuts the
        wait short (a second Ctrl-C)."""
        try:
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while not self.exited.wait(0.05):
                if time.monotonic() >= deadline or interrupted():
                    break
        finally:
            self.signal_group(signal.SIGKILL)

    def reap(self, timeout: float = 2.0) -> None:
        """After the leader exited: kill whatever is left of the group and drain the output."""
        self.signal_group(signal.SIGKILL)
        self.exited.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)

    def send_if_handled(self, sig: signal.Signals) -> bool:
        """Signal the training process only if it installed a handler: the default action of
        SIGUSR1 is to terminate, and a script that ignores requests must lose nothing."""
        pid = self.worker_pid
        return pid is not None and catches(pid, sig) and _kill(pid, sig)

    def dump_stack(self) -> None:
        """py-spy if installed; else SIGABRT, which the worker's faulthandler turns into a dump of
        every thread's stack (PYTHONFAULTHANDLER is set for it)."""
        pid = self.worker_pid
        if pid is None:
            return
        if shutil.which("py-spy"):
            out = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True,
                                 timeout=30, check=False)
            with os.fdopen(open_log(self.log_path), "a") as fh:  # never through a planted symlink
                fh.write(out.stdout + out.stderr)
        else:
            _kill(pid, signal.SIGABRT)
            self.exited.wait(3.0)


_SHELLS = frozenset({"sh", "bash", "dash", "zsh"})


def _through_shells(pid: int | None) -> int | None:
    """The process a wrapper shell runs (``bash -c 'cd x && python train.py'``): a shell with one
    child is not the training process, its child is."""
    try:
        proc = psutil.Process(pid) if pid is not None else None
        while proc is not None and proc.name() in _SHELLS and len(children := proc.children()) == 1:
            proc = children[0]
        return proc.pid if proc is not None else None
    except psutil.Error:
        return pid


def catches(pid: int, sig: signal.Signals) -> bool:
    """Does the process have a handler for ``sig``? (the SigCgt mask in /proc/PID/status)"""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def _kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
