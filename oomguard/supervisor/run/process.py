"""Starting, watching and stopping one worker: what it is started with (its argv with the placeholders
filled, its environment and files), and every OS call for the worker, behind ``WorkerProcess``.

Tested in tests/unit/supervisor/run/test_process.py, tests/e2e/test_operator.py, tests/e2e/faults/test_output.py.

The worker runs under ``launch.py`` in a session of its own, so one ``killpg`` reaches the whole
tree. Its merged stdout/stderr is drained in chunks as it streams (``OutputPump``), passed to the
console untouched, appended to the attempt's log file and cut into lines for the loop's line callback.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import psutil

import oomguard
from oomguard.common import protocol
from oomguard.probe import SITE_DIR
from oomguard.supervisor.command import SHELLS, render
from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide.classify import OwnCode
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.observe.sampler import process_rank
from oomguard.supervisor.record.journal import Degradations
from oomguard.supervisor.record.logs import AttemptLog, open_log

# Cutting the worker's output stream into lines, cheaply and with a bound, as journald does.
#
# The output thread reads the pipe in chunks of whatever is there. ``LineSplitter`` turns them into
# lines: ``\n``, ``\r\n`` and a bare ``\r`` all end a line (a tqdm bar redraws with ``\r``; each redraw
# is progress), and a line longer than ``line_max`` is handed on in pieces (journald's ``LineMax``)
# instead of being buffered whole, so one 50 MiB line without a newline costs no more memory than
# ``line_max``.
#
# What is looked at is bounded per read, not per byte: a read that holds more than ``flood_lines``
# lines (or ``recent_bytes`` of them) means the worker writes faster than anyone can look at each line
# (a flood, or the reader fell behind), and only its newest lines are handed on: the latest progress,
# and the tail where a failure's traceback is. The rest still reaches the log file and the console;
# it is only not looked at. Measured on a 2-core box, even one substring search over every byte of a
# 200 MB flood costs as much CPU as the worker spends writing it, so nothing scans the whole stream.


LINE_MAX = 48 * 1024  # bytes; journald's default LineMax
FLOOD_LINES = 64  # at most this many lines of one read are handed on (the newest)
RECENT_BYTES = 16 * 1024  # and only from its last this many bytes
OVERLONG_PIECES = 2  # pieces of an overlong line handed on per read (the newest)
_BREAK = re.compile(rb"\r\n|\r|\n")


class LineSplitter:
    """Feed it the chunks read from the pipe; it returns the complete lines to look at."""

    def __init__(self, line_max: int = LINE_MAX, flood_lines: int = FLOOD_LINES,
                 recent_bytes: int = RECENT_BYTES) -> None:
        self.line_max = line_max
        self.flood_lines = flood_lines
        self.recent_bytes = max(recent_bytes, line_max)
        self._partial = b""
        self._after_cr = False  # the last read ended in \r: a \n starting the next one is the same end
        self.skipped_bytes = 0  # bytes of floods not looked at

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        data = self._partial + chunk if self._partial else chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            self._partial = data
            return self._overlong()
        end = cut - 1 if data[cut - 1:cut + 1] == b"\r\n" else cut
        complete, self._partial = data[:end], data[cut + 1:]
        return self._newest(complete) + self._overlong()

    def flush(self) -> list[bytes]:
        """At the end of the stream: the last line, if it had no newline."""
        rest, self._partial = self._partial, b""
        return _pieces(rest, self.line_max)[-OVERLONG_PIECES:] if rest else []

    def _newest(self, complete: bytes) -> list[bytes]:
        """The newest lines of ``complete``: all of them, unless it is a flood."""
        start = len(complete) - self.recent_bytes
        if start > 0:  # begin at a line boundary, so no line is handed on cut in half
            start = max(complete.rfind(b"\n", 0, start), complete.rfind(b"\r", 0, start)) + 1
            self.skipped_bytes += start
        recent = complete[max(start, 0):]
        lines = _BREAK.split(recent) if b"\r" in recent else recent.split(b"\n")
        self.skipped_bytes += sum(len(ln) + 1 for ln in lines[:-self.flood_lines])
        return _capped(lines[-self.flood_lines:], self.line_max)

    def _overlong(self) -> list[bytes]:
        """A partial line past the cap goes out in pieces of ``line_max`` now (the newest of them)."""
        if len(self._partial) < self.line_max:
            return []
        whole = len(self._partial) - len(self._partial) % self.line_max
        out = _pieces(self._partial[:whole], self.line_max)
        self._partial = self._partial[whole:]
        self.skipped_bytes += sum(len(p) for p in out[:-OVERLONG_PIECES])
        return out[-OVERLONG_PIECES:]


def _pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def _capped(lines: list[bytes], line_max: int) -> list[bytes]:
    return [piece for ln in lines for piece in (_pieces(ln, line_max) if len(ln) > line_max else [ln])]


# The output thread: drains the worker's pipe, whatever else fails.
#
# A worker blocks on ``print`` as soon as nobody reads its pipe, and a blocked worker looks hung. So
# this thread's one duty is to keep reading: it reads chunks with ``os.read`` (no line buffering, no
# waiting for a newline), and hands each chunk to the log (buffered, capped, degrading on a full
# disk), to the console, and to ``LineSplitter`` for the lines worth looking at. Any of those failing
# is reported as a degradation and the reading goes on; a read that times out flushes the log, so a
# quiet worker's last lines still reach the file.


READ_SIZE = 1 << 20  # the pipe is widened to this where the kernel allows (pipe-max-size is 1 MiB by default)
FLUSH_EVERY = 0.25  # seconds of silence after which the log buffer is written out


@dataclass
class OutputPump:
    fd: int
    log: AttemptLog
    echo: Callable[[bytes], None] | None
    on_line: Callable[[str], None]
    problems: Degradations | None = None
    splitter: LineSplitter = field(default_factory=LineSplitter)
    last_output: float = field(default_factory=time.monotonic)  # any byte counts: a \r progress bar is output
    _flushed: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        _widen(self.fd)

    def run(self) -> None:
        try:
            while self._step():
                pass
            self._lines(self.splitter.flush())
        finally:
            self._guard("log", self.log.close)

    def _step(self) -> bool:
        """One read; False at the end of the stream."""
        try:
            ready, _, _ = select.select([self.fd], [], [], FLUSH_EVERY)
            if not ready:
                self._flush()
                return True
            chunk = os.read(self.fd, READ_SIZE)
        except InterruptedError:
            return True
        except OSError as exc:  # the pipe itself is broken: nothing more will come
            self._report("output", exc)
            return False
        if not chunk:
            return False
        self.last_output = time.monotonic()
        self._guard("log", self.log.write, chunk)
        if self.last_output - self._flushed >= FLUSH_EVERY:  # a steady trickle is written out too
            self._flush()
        self._echo(chunk)
        self._lines(self.splitter.feed(chunk))
        return True

    def _flush(self) -> None:
        self._flushed = time.monotonic()
        self._guard("log", self.log.flush)

    def _lines(self, lines: list[bytes]) -> None:
        for raw in lines:
            self._guard("output", self.on_line, raw.decode("utf-8", "replace"))

    def _echo(self, chunk: bytes) -> None:
        if self.echo is None:
            return
        try:
            self.echo(chunk)
        except (OSError, ValueError):  # the terminal went away; supervision goes on
            self.echo = None

    def _guard(self, component: str, action: Callable[..., object], *args: object) -> None:
        try:
            action(*args)
        except Exception as exc:  # a bug or a full disk here must not stop the draining
            self._report(component, exc)

    def _report(self, component: str, exc: BaseException) -> None:
        if self.problems is not None:
            self.problems.failed(component, exc)


def _widen(fd: int) -> None:
    """A 1 MiB pipe instead of 64 KiB: a flooding worker blocks 16× less often, and each wake-up of
    this thread takes 16× more (the per-read cost is what limits throughput)."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), READ_SIZE)
    except OSError:  # an unprivileged user past pipe-user-pages-soft: 64 KiB still works
        return


_PACKAGE = os.path.dirname(os.path.abspath(oomguard.__file__))
# Where the worker's tracebacks show our code: the probe's files (SITE_DIR is under this directory)
# and the spare's bootstrap are handed to it by these paths; with links resolved too.
OWN_CODE = OwnCode(tuple(dict.fromkeys((_PACKAGE, os.path.realpath(_PACKAGE)))))


@dataclass(frozen=True)
class AttemptFiles:
    log: Path
    events: Path
    checkpoint_request: Path

    @staticmethod
    def of(run_dir: Path, attempt: int) -> AttemptFiles:
        return AttemptFiles(run_dir / "logs" / f"attempt-{attempt}.log",
                            run_dir / "logs" / f"attempt-{attempt}.events.jsonl",
                            run_dir / "checkpoint.request")


def placeholder_values(config: RunConfig, plan: Plan, attempt: int,
                       checkpoint: Checkpoint | None) -> dict[str, object]:
    batch = plan.batch
    return {
        "micro_batch": batch.micro_batch, "grad_accum": batch.grad_accum,
        # summed over the ranks: for scripts that divide it by the world size (nanoGPT under torchrun)
        "grad_accum_total": batch.grad_accum * batch.world_size,
        "global_batch": batch.global_batch, "world_size": batch.world_size,
        "checkpoint": checkpoint.path if checkpoint else "",
        "checkpoint_step": checkpoint.step if checkpoint and checkpoint.step is not None else "",
        "attempt": attempt, "run_dir": str(config.run_dir.resolve()),
        "eval_micro_batch": plan.eval_micro_batch, "num_workers": plan.num_workers,
    }


def build_argv(config: RunConfig, plan: Plan, values: Mapping[str, object]) -> list[str]:
    """The command with placeholders filled, resume args (only with a checkpoint) and fallbacks."""
    words = list(config.command)
    if values["checkpoint"]:
        words += shlex.split(config.checkpoints.resume_args)
    for extra in config.batch.fallback_args[:plan.fallbacks_applied]:
        words += shlex.split(extra)
    return [render(word, values) for word in words]


# The allocator's settings live under two names. torch 2.13 (read in its installed source,
# c10/core/AllocatorConfig.h and c10/cuda/CUDAAllocatorConfig.h): the device-generic settings, among
# them expandable_segments, read PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF only when it is
# unset; the CUDA-only settings read PYTORCH_CUDA_ALLOC_CONF first. Releases before 2.9 read only
# PYTORCH_CUDA_ALLOC_CONF. So the option is merged into every name the user set (each keeps its
# own other settings and wins where it won before), and a name the user left unset gets the user's
# settings too, so that whichever name the worker's torch reads carries expandable_segments:True.
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def with_expandable_segments(current: str | None) -> str:
    """Allocator settings with expandable_segments:True, keeping the user's other settings."""
    parts = [p for p in (current or "").split(",")
             if p.strip() and not p.strip().startswith("expandable_segments")]
    return ",".join([*parts, "expandable_segments:True"])


def merge_alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables to set for expandable segments, given the worker's environment."""
    user = alloc_conf(env)
    fallback = next(iter(user.values()), None)  # the new name's value first: it wins on new releases
    return {name: with_expandable_segments(user.get(name, fallback)) for name in ALLOC_CONF_NAMES}


def alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator settings the worker gets (for status): the names that are set."""
    return {name: env[name] for name in ALLOC_CONF_NAMES if env.get(name)}


# The placeholders' values every attempt's environment carries too, by variable.
PLACEHOLDER_ENV = {protocol.ENV_MICRO_BATCH: "micro_batch", protocol.ENV_GRAD_ACCUM: "grad_accum",
                   protocol.ENV_GLOBAL_BATCH: "global_batch", protocol.ENV_WORLD_SIZE: "world_size",
                   protocol.ENV_CHECKPOINT: "checkpoint", protocol.ENV_CHECKPOINT_STEP: "checkpoint_step",
                   protocol.ENV_ATTEMPT: "attempt", protocol.ENV_RUN_DIR: "run_dir"}


def build_env(config: RunConfig, plan: Plan, values: Mapping[str, object], files: AttemptFiles) -> dict[str, str]:
    env = {**os.environ, **{name: str(values[key]) for name, key in PLACEHOLDER_ENV.items()}}
    env.update({
        protocol.ENV_EVENTS: str(files.events.resolve()),
        protocol.ENV_CHECKPOINT_REQUEST: str(files.checkpoint_request.resolve()),
        protocol.ENV_CHECKPOINT_SIGNAL: config.checkpoints.signal,
    })
    # Output must stream for OOM text to be seen as it happens; a hang dump needs faulthandler.
    env.pop("NOTIFY_SOCKET", None)  # systemd talks to the supervisor, not to its worker
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if plan.expandable_segments:
        env.update(merge_alloc_conf(env))
    if config.probe:
        env["PYTHONPATH"] = with_probe(env.get("PYTHONPATH", ""))
    return env


def with_probe(pythonpath: str) -> str:
    """The worker's PYTHONPATH with the probe's sitecustomize directory first, inherited by every Python
    process it starts (docs/probe.md); it holds only sitecustomize.py, which runs the user's own."""
    rest = [entry for entry in pythonpath.split(os.pathsep) if entry and entry != SITE_DIR]
    return os.pathsep.join([SITE_DIR, *rest])


def expandable_already(env: Mapping[str, str]) -> bool:
    """The user set the option under the name their torch reads first (new name, else old)."""
    value = next(iter(alloc_conf(env).values()), "")
    return "expandable_segments:true" in value.replace(" ", "").lower()


LAUNCHER = str(Path(__file__).with_name("launch.py"))
WORKER_OOM_SCORE_ADJ = 500  # above the supervisor's, so the kernel picks the worker, not us


def launch(command: Sequence[str], oom_score_adj: int, procs: Path | None, cwd: Path, env: Mapping[str, str],
           stdin: int) -> subprocess.Popen[bytes]:
    """``command`` under the launcher in a session of its own, its output merged into one pipe."""
    return subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER, str(os.getpid()), str(oom_score_adj),
                             str(procs) if procs else "-", "--", *command], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)


def worker_oom_score_adj() -> int:
    """The worker's OOM score: ours plus WORKER_OOM_SCORE_ADJ."""
    try:
        own = int(Path("/proc/self/oom_score_adj").read_text())
    except (OSError, ValueError):
        own = 0
    return min(1000, own + WORKER_OOM_SCORE_ADJ)


@dataclass(eq=False)
class WorkerProcess:
    """One attempt's worker process group."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: Path
    log_path: Path
    on_line: Callable[[str], None]
    echo: Callable[[bytes], None] | None
    cgroup_procs: Path | None = None
    _: KW_ONLY
    log_max_bytes: int | None = None
    problems: Degradations | None = None
    exited: threading.Event = field(default_factory=threading.Event)
    exited_at: float | None = None  # monotonic: when the worker's exit was seen
    returncode: int | None = None
    _started: float = field(default_factory=time.monotonic)
    _pump: OutputPump | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _reader: threading.Thread | None = None
    _worker_pid: int | None = None
    _named: dict[str, object] = field(default_factory=dict)

    @property
    def last_output(self) -> float:
        """When the worker last wrote anything (a \r progress redraw included)."""
        return self._pump.last_output if self._pump is not None else self._started

    @property
    def pgid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self, wake: threading.Event, spare: subprocess.Popen[bytes] | None = None) -> None:
        """Start the worker under its launcher, or watch ``spare``, a spare's launcher just handed over."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._proc = spare or launch(self.argv, worker_oom_score_adj(), self.cgroup_procs, self.cwd, self.env,
                                     subprocess.DEVNULL)
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
        """Each rank's training process (the topmost with that ``RANK``) under torchrun or accelerate."""
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
        """The training process (not ``launch.py``) and the ranks' pids, for status; only when changed."""
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
        return _kill(-self.pgid, sig)  # a negative pid: the whole process group

    def stop(self, grace: float, interrupted: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM the group, wait up to ``grace`` s (or until ``interrupted``: a second Ctrl-C), SIGKILL."""
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
        """py-spy if installed; else SIGABRT, which the worker's faulthandler turns into a stack dump."""
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


def _through_shells(pid: int | None) -> int | None:
    """A wrapper shell with one child (``bash -c 'cd x && python train.py'``) stands for its child."""
    try:
        proc = psutil.Process(pid) if pid is not None else None
        while proc is not None and proc.name() in SHELLS and len(children := proc.children()) == 1:
            proc = children[0]
        return proc.pid if proc is not None else None
    except psutil.Error:
        return pid


def catches(pid: int, sig: signal.Signals) -> bool:
    """Does the process have a handler for ``sig``? (the SigCgt mask in /proc/PID/status)"""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
