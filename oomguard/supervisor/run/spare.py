"""A spare worker interpreter: started while an attempt runs, it has imported the script's heavy
modules (torch, transformers, lightning) by the time the attempt ends, and becomes the next worker.

Only for ``python [flags] script.py ...`` (a launcher, ``-m``, ``-c`` start cold). It runs under
``launch.py`` like a worker, in a memory cgroup of its own that becomes the next attempt's, at a lower
CPU priority and the highest OOM score, never initializes CUDA (``sparestart.py``), and is used only
when the next attempt's interpreter, flags, script and environment (but oomguard's per-attempt
variables and the allocator settings) are the ones it was started with; else the worker starts cold.
After a kernel OOM kill of the worker, no more spares: their memory would be the worker's. Beside
the next attempt's spare, a reserve (``decide/policy.py``) so back-to-back OOMs do not outrun them.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import resource
import signal
import subprocess
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from oomguard.common import protocol
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.policy import (
    POOL,
    SPARE_GUESS,
    Limit,
    WorkerMemory,
    reserve_fits,
    spare_room,
    spares_to_start,
    worker_score,
)
from oomguard.supervisor.observe.cgroup import SharedLimit, shared_limit
from oomguard.supervisor.run.containment import Containment
from oomguard.supervisor.run.process import ALLOC_CONF_NAMES, WORKER_OOM_SCORE_ADJ, launch, worker_oom_score_adj

BOOTSTRAP = str(Path(__file__).with_name("sparestart.py"))
SPARE_OOM_SCORE_ADJ = 1000  # if memory runs out while it waits, the kernel takes the spare first
SPARE_NICE = 10
RESERVE_NICE = 19  # a reserve started beside a spare still importing takes only the CPU time left over
READY_TIMEOUT = 300.0  # seconds a handover waits for a spare still importing (a cold start would too)
# Interpreter flags that change nothing the spare does before the handover differently from a
# direct run (-I and -P change sys.path; -c, -m, -i and - are not a script).
_PLAIN_FLAGS = set("BEObqsuv")
_FLAGS_WITH_VALUE = ("-W", "-X")
LAUNCHERS = {"torchrun", "accelerate", "deepspeed", "lightning", "composer", "mpirun", "srun"}
MAX_FILES = 50  # local modules followed when reading the script's imports


@dataclass(frozen=True)
class Target:
    """``python [flags] script [args]``: what a spare can become."""

    python: str
    flags: tuple[str, ...]
    script: str
    args: tuple[str, ...]

    def same_program(self, other: Target) -> bool:
        return (self.python, self.flags, self.script) == (other.python, other.flags, other.script)


def target_of(argv: Sequence[str]) -> Target | str:
    """The command as a script a spare can run, or why it cannot."""
    if not argv:
        return "no command"
    name = os.path.basename(argv[0])
    if name in LAUNCHERS:
        return f"{name} starts its own workers"
    if not name.startswith("python"):
        return f"{name} is not a Python interpreter"
    flags: list[str] = []
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        token = argv[i]
        if token in _FLAGS_WITH_VALUE and i + 1 < len(argv):
            flags += [token, argv[i + 1]]
            i += 2
            continue
        if not (token.startswith(_FLAGS_WITH_VALUE) or set(token[1:]) <= _PLAIN_FLAGS) or token == "-":
            return f"python {token} is not a plain script run"
        flags.append(token)
        i += 1
    if i >= len(argv):
        return "no script"
    return Target(argv[0], tuple(flags), argv[i], tuple(argv[i + 1:]))


def runs_as_file(script: Path) -> bool:
    """Does ``python script`` run the file itself, as a handover does (not a directory's or zip's __main__)?"""
    try:
        return script.is_file() and not zipfile.is_zipfile(script)
    except OSError:
        return False


def path0(script: str, cwd: Path) -> str:
    """What ``python script.py`` puts first on sys.path: the script's directory, links resolved."""
    return os.path.dirname(os.path.realpath(cwd / script))


# Modules a training script imports without naming them: creating any torch optimizer imports
# torch._dynamo (torch/optim/optimizer.py), several seconds of the restart path's "model build".
# Taken only when the script imports torch (or a trainer on top of it) and its source says it
# trains (an optimizer, a Trainer): an inference script would not load it.
TRAINING_WORDS = ("optim", "Trainer")
TRAINS_WITH_TORCH = ("torch", "transformers", "lightning", "pytorch_lightning", "accelerate")
FOLLOW_ON = "torch._dynamo"


def heavy_imports(script: Path) -> list[str]:
    """What the script imports, read from its source and its own modules' (never run): each as
    ``module`` or ``module:name,name``; which are third-party is decided in the worker's interpreter."""
    root = script.parent
    found: list[str] = []
    trains = False
    todo, seen = [script], set[Path]()
    while todo and len(seen) < MAX_FILES:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            text = path.read_text()
            tree = ast.parse(text, str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        trains = trains or any(word in text for word in TRAINING_WORDS)
        for item in _imports(tree):
            top = item.partition(":")[0].split(".")[0]
            local = [p for p in (root / f"{top}.py", root / top / "__init__.py") if p.exists()]
            todo += local
            if not local and item not in found:
                found.append(item)
    if trains and any(item.partition(":")[0].split(".")[0] in TRAINS_WITH_TORCH for item in found):
        found.append(FOLLOW_ON)
    return found


def _imports(tree: ast.AST) -> list[str]:
    """The imports every run executes: at module level, not in functions, which may never be called (a
    module the script would not import must not be in the worker)."""
    items = []
    todo = [tree]
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            items += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [alias.name for alias in node.names if alias.name != "*"]
            items.append(f"{node.module}:{','.join(names)}" if names else node.module)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.expr)):
            todo += ast.iter_child_nodes(node)
    return items


def per_attempt(name: str) -> bool:
    """May differ at a handover: oomguard's own variables and the allocator's (read at the first CUDA use)."""
    return name.startswith("OOMGUARD_") or name in ALLOC_CONF_NAMES


def env_differences(started: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    """The variables, besides the per-attempt ones, that differ: an import may have read them."""
    names = {*started, *wanted}
    return sorted(n for n in names if not per_attempt(n) and started.get(n) != wanted.get(n))


def can_restore_priority() -> bool:
    """Can a spare's threads get back a worker's priority (root, or RLIMIT_NICE allows nice 0)?"""
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


@dataclass(eq=False)  # one spare is itself, whatever its figures
class Spare:
    """One spare interpreter under its launcher, in its own cgroup, waiting for a handover."""

    target: Target
    env: dict[str, str]
    cwd: Path
    containment: Containment
    ready_file: Path
    worker_adj: int = field(default_factory=worker_oom_score_adj)  # the OOM score it takes as the worker
    proc: subprocess.Popen[bytes] | None = None
    started: float = field(default_factory=time.monotonic)
    handover: tuple[Target, dict[str, str], int] | None = None  # what it becomes: argv, env, nice
    pid: int | None = None  # its interpreter's (the launcher's child), from its ready record
    lost: str | None = None  # at the handover: it had exited already, and how (decide/classify.py)
    imported_size: int | None = None  # its rss once it has imported
    nice: int = 0  # above the supervisor's, as last set
    start_nice: int = 0  # what its interpreter sets itself to as it starts (``os.nice``, relative)
    settled: bool = False  # a renice began after its ready record: after its own ``os.nice``, so it holds

    def start(self, imports: Sequence[str], nice: int = SPARE_NICE) -> None:
        """Start it at ``nice`` above our priority, or at ours where it could not be raised back."""
        nice = nice if can_restore_priority() else 0
        self.nice = self.start_nice = nice
        command = [self.target.python, *self.target.flags, BOOTSTRAP, str(self.ready_file), str(nice),
                   path0(self.target.script, self.cwd), *imports]
        self.ready_file.unlink(missing_ok=True)
        self.proc = launch(command, SPARE_OOM_SCORE_ADJ, self.containment.procs, self.cwd, self.env, subprocess.PIPE)

    def renice(self, nice: int) -> None:
        """Its interpreter's threads to ``nice`` above ours (a cold worker inherits ours)."""
        assert self.proc is not None
        ready = self.is_ready()  # read first: its interpreter wrote it after it set its start nice
        try:
            pids = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            return
        value = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        for pid in pids:
            for tid in _threads(pid):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, tid, value)
        self.nice, self.settled = nice, ready

    def is_ready(self) -> bool:
        """Has it finished importing (its ready record written, whatever it says)?"""
        return self.ready_file.exists()

    def size(self) -> int:
        """Its ``rss`` once it has imported: what a reserve started like it will hold."""
        if self.imported_size is None and self.proc is not None and self.is_ready():
            self.imported_size = self.rss()
        return self.imported_size or 0

    def rss(self) -> int:
        """Its resident memory now, launcher and interpreter together (bytes; 0 once it is gone)."""
        if self.proc is None:
            return 0
        try:
            launcher = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in (launcher, *launcher.children(recursive=True)))
        except psutil.Error:
            return 0

    def ready(self, timeout: float, interrupted: Callable[[], bool]) -> dict[str, object] | str:
        """Wait until it has imported (its ready record), or why it cannot be used."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        hurried = 0.0
        while True:
            if time.monotonic() - hurried >= 0.25:  # again and again: a spare not yet started sets its own nice
                self.renice(0)  # the next attempt waits for it: back to a worker's priority
                hurried = time.monotonic()
            if self.ready_file.exists():
                try:
                    record: dict[str, object] = json.loads(self.ready_file.read_text())
                except (OSError, ValueError):
                    record = {}
                if record and not record.get("ok"):
                    return f"the spare is unusable: {record.get('why')}"
                if record and self.proc.poll() is None:
                    return record
            if self.proc.poll() is not None:  # before its record, or since (the OOM killer takes a spare first)
                return f"the spare exited ({self.proc.returncode}) before it was needed"
            if interrupted() or time.monotonic() >= deadline:
                return "the spare was not ready in time"
            time.sleep(0.02)

    def hand_over(self) -> subprocess.Popen[bytes]:
        """Make it the worker, as a direct run would be; its launcher, which the worker's watcher owns."""
        assert self.proc is not None and self.proc.stdin is not None and self.handover is not None
        target, env, nice = self.handover
        spec = {"argv": [target.script, *target.args], "env": dict(env), "cwd": str(self.cwd),
                "script": os.path.abspath(self.cwd / target.script), "path0": path0(target.script, self.cwd),
                "nice": nice, "oom_score_adj": self.worker_adj}
        self.lost = self._gone()  # the script will not run: what ends this attempt is the spare's, not its
        with contextlib.suppress(OSError):  # the launcher back to a worker's OOM score too (it is the spare's parent)
            Path(f"/proc/{self.proc.pid}/oom_score_adj").write_text(str(self.worker_adj))
        self.ready_file.unlink(missing_ok=True)
        pipe, self.proc.stdin = self.proc.stdin, None  # a worker has no stdin of ours
        # it died since it was ready: the worker's watcher sees its exit as an attempt's
        with contextlib.suppress(OSError):
            pipe.write(json.dumps(spec).encode())
            pipe.close()
        return self.proc

    def _gone(self) -> str | None:
        """How it had exited before the handover (the OOM killer takes a spare first), or None."""
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            how = f"killed by {signal.Signals(-code).name}" if -code in signal.Signals._value2member_map_ else (
                f"exit status {code}")
            return f"it had exited before the handover, {how}"
        try:
            running = self.pid is None or psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            running = False
        return None if running else "its interpreter had exited before the handover"

    def discard(self) -> None:
        """SIGKILL its process group and its cgroup; reap it."""
        if self.proc is not None:
            # Only while it is not reaped: a reaped leader's pid, and so its group's id, may belong to
            # another process by now; what is left of a reaped spare dies with its cgroup below.
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
        self.containment.remove()
        self.ready_file.unlink(missing_ok=True)


def host_memory() -> tuple[int, int]:
    """The host's available and total memory, in bytes."""
    vm = psutil.virtual_memory()
    return vm.available, vm.total


@dataclass(eq=False)
class Spares:
    """The run's spare interpreters, oldest first: the next attempt's, and a reserve (``decide/policy.py``
    says when). ``memory`` and ``limit`` are seams for the tests; ``say`` puts why one is held back in status."""

    enabled: bool
    run_dir: Path
    cwd: Path
    memory_limit: int | None
    event: Callable[..., None]
    memory: Callable[[], tuple[int, int]] = host_memory
    limit: Callable[[], SharedLimit | None] = shared_limit
    say: Callable[[dict[str, object] | None], None] = lambda doc: None
    worker: WorkerMemory = field(init=False)  # the loop's samples (``observe``)
    _seen: int = 0
    _trained: bool = False
    _told: bool = False
    _scores: dict[int, int] = field(default_factory=dict)  # the OOM score last written to each worker process
    held_back: str = ""  # why no spare is started now; said once a run (journal, status)
    pool: list[Spare] = field(default_factory=list)
    reserve: bool = True  # off for the run once the host's memory ran short or the kernel killed a spare
    _command: tuple[list[str], dict[str, str]] | None = None  # what the spares are started for
    _made: int = 0

    def __post_init__(self) -> None:
        self.worker = WorkerMemory(0, bound=self.memory_limit)
        self.dir = self.run_dir / "spare"

    @property
    def spare(self) -> Spare | None:
        """The next attempt's spare (the oldest)."""
        return self.pool[0] if self.pool else None

    def prepare(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        """Start a spare for the next attempt of this command, where it can have one."""
        target = target_of(argv)
        if not self.enabled or isinstance(target, str) or not runs_as_file(self.cwd / target.script):
            self._command = None
            return
        self._command = (list(argv), dict(env))
        self._scores.clear()  # a new worker: its pids are new (one may reuse an old one's)
        self._fill(reserve=False)

    def tick(self) -> None:
        """Every loop tick: drop a spare the kernel killed, the newest when the worker grew into its room, the
        reserve when the host runs short; raise a reserve once the spare before it imported; start more."""
        if not self.enabled or self._command is None:
            return
        if self._gone() or self._over_budget():
            return
        if len(self.pool) >= POOL and not self._reserve_fits(self._reserve_size(), held=True):
            self.reserve = False
            self._drop(self.pool[-1], "the host's memory ran short: no reserve spare for the rest of the run",
                       "spare_reserve_off")
            return
        for older, spare in zip(self.pool, self.pool[1:], strict=False):
            if spare.nice > SPARE_NICE and older.is_ready():
                spare.renice(SPARE_NICE)
        for spare in self.pool:
            # Again each tick, once changed since its start, until a renice began after its ready record:
            # its interpreter applies its start nice itself (relative, so 10 + 19 is 19), maybe after ours.
            # One never changed sets the right nice itself: no renice (a scan of every process for its
            # children) each tick.
            if spare.nice != spare.start_nice and not spare.settled:
                spare.renice(spare.nice)
        self._fill(self.reserve and self._reserve_fits(self._reserve_size()))

    def observe(self, now: int, trained: bool, pids: Sequence[int] = ()) -> None:
        """The worker's memory at a sample; ``trained``: a step was taken, so the highest figure is its peak.
        ``pids`` get the OOM score that keeps the kernel taking a spare first."""
        self._seen = max(now, self._seen)  # the peak so far
        self._trained = self._trained or trained
        self.worker = WorkerMemory(now, self._seen if self._trained else None, self.memory_limit)
        if pids and (self.pool or self._scores):
            self._score(pids)

    def _score(self, pids: Sequence[int]) -> None:
        """Each worker process's oom_score_adj below a spare's (``worker_score``) while one is held; where it
        cannot be lowered, no spares for the run: the kernel could end the worker in a spare's place."""
        sizes = [spare.rss() for spare in self.pool]
        own = worker_oom_score_adj() - WORKER_OOM_SCORE_ADJ
        target = worker_score(own, [size for size in sizes if size], self.budget().limit + psutil.swap_memory().total)
        for pid in pids:
            # Only the scores of processes that a spare stands beside, or that we lowered: any other
            # is the launcher's, or the script's own choice.
            if self._scores.get(pid) == target or (not sizes and pid not in self._scores):
                continue
            try:
                Path(f"/proc/{pid}/oom_score_adj").write_text(str(target))
            except FileNotFoundError:
                continue  # it exited since the sample
            except OSError as exc:
                self.enabled = False
                self.discard()
                self.event("spare_off", why="the worker's OOM score cannot be lowered below a spare's "
                            f"({exc.strerror})")
                return
            self._scores[pid] = target

    def budget(self) -> Limit:
        """The tightest limit holding the worker and its spares: a cgroup's below the host's, else the host."""
        available, total = self.memory()
        shared = self.limit()
        if shared is None or shared.limit_bytes >= total:
            return Limit(total, total - available, "the host's memory", False)
        return Limit(shared.limit_bytes, shared.counted_bytes, "the cgroup limit", True)

    def _gone(self) -> bool:
        """Drop spares killed while they waited: never the worker's death; ``_drop`` ends the reserve."""
        gone = [spare for spare in self.pool if spare.proc is not None and spare.proc.poll() == -signal.SIGKILL]
        for spare in gone:
            self._drop(spare, "the spare was killed (SIGKILL) while it waited")
        return bool(gone)

    def _over_budget(self) -> bool:
        """Drop the newest spare when the worker has grown into the room it holds."""
        if not self.pool:
            return False
        newest, held = self.pool[-1], sum(spare.rss() for spare in self.pool)
        why = spare_room(self.budget(), self.worker, held, newest.rss(), running=True)
        if why:
            self._drop(newest, why)
            self._hold_back(why)
        return bool(why)

    def _hold_back(self, why: str) -> None:
        """Say once a run, in the journal and for status, why a spare is not started (or kept)."""
        if not self._told:
            self._told = True
            self.event("spare_held_back", why=why)
        if not self.held_back:
            self.say({"state": "not started", "why": why})
        self.held_back = why

    def _fill(self, reserve: bool) -> None:
        """Start what the policy says where the limit leaves room; one behind an importing spare at RESERVE_NICE."""
        importing = sum(not spare.is_ready() for spare in self.pool)
        count = spares_to_start(len(self.pool) - importing, importing, reserve, can_restore_priority())
        if count:
            held = sum(spare.rss() for spare in self.pool)
            why = spare_room(self.budget(), self.worker, held, self._reserve_size() or SPARE_GUESS)
            if why:
                self._hold_back(why)
                return
            if self.held_back:
                self.held_back = ""
                self.say(None)
        for _ in range(count):
            behind = any(not spare.is_ready() for spare in self.pool)
            if self._command is None or not self._start(*self._command, RESERVE_NICE if behind else SPARE_NICE):
                return

    def _reserve_size(self) -> int:
        """What a reserve holds, or will: the largest spare that has imported (0 before any has)."""
        return max((spare.size() for spare in self.pool if spare.is_ready()), default=0)

    def _reserve_fits(self, size: int, held: bool = False) -> bool:
        """Does the host keep its margin beside a reserve of ``size`` (``held``: one already running)?"""
        available, total = self.memory()
        return reserve_fits(available + (size if held else 0), total, size)

    def _start(self, argv: Sequence[str], env: Mapping[str, str], nice: int) -> bool:
        target = target_of(argv)
        assert not isinstance(target, str)
        self._made += 1
        self.dir.mkdir(parents=True, exist_ok=True)
        containment = Containment.create(f"oomguard-{os.getpid()}-spare-{self._made}", self.memory_limit)
        spare = Spare(target, self._spare_env(env), self.cwd, containment, self.dir / f"ready-{self._made}.json")
        imports = heavy_imports(self.cwd / target.script)
        try:
            spare.start(imports, nice)
        except OSError as exc:
            spare.discard()
            self._command = None  # not again before the next attempt asks
            self.event("spare_failed", why=str(exc))
            return False
        assert spare.proc is not None
        self.event("spare_started", pid=spare.proc.pid, imports=imports, reserve=bool(self.pool), nice=spare.nice)
        self.pool.append(spare)
        return True

    def _spare_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The attempt's environment without its per-attempt variables, but with a channel of the spare's own:
        the probe loads only where OOMGUARD_EVENTS is set, and rereads it, so it follows the handover."""
        spare_env = {k: v for k, v in env.items() if not k.startswith("OOMGUARD_")}
        if env.get(protocol.ENV_EVENTS):
            spare_env[protocol.ENV_EVENTS] = str(self.dir / f"events-{self._made}.jsonl")
        return spare_env

    def take(self, argv: Sequence[str], env: Mapping[str, str], interrupted: Callable[[], bool]) -> Spare | None:
        """The oldest ready spare to become this attempt's worker, or None; unfit ones are dropped, said why."""
        target = target_of(argv)
        for spare in list(self.pool):
            why = self._unfit(spare, target, env)
            if why:
                self._drop(spare, why)
        began = time.monotonic()
        while self.pool and not isinstance(target, str):
            spare = self.pool.pop(0)
            was_ready = spare.is_ready()
            record = spare.ready(max(0.0, READY_TIMEOUT - (time.monotonic() - began)), interrupted)
            if isinstance(record, str):
                self._drop(spare, record)
                continue
            spare.containment.oom_kills_before = spare.containment.oom_kills()
            spare.handover = (target, dict(env), int(str(record.get("nice", 0))))
            spare.pid = pid if isinstance(pid := record.get("pid"), int) else None
            self.event("spare_used", age=round(time.monotonic() - spare.started, 2), imported=record.get("imported"),
                        ready=was_ready, waited=round(time.monotonic() - began, 2))
            return spare
        return None

    def _unfit(self, spare: Spare, target: Target | str, env: Mapping[str, str]) -> str:
        if isinstance(target, str):
            return target
        if not spare.target.same_program(target):
            return "the command's interpreter, flags or script changed"
        changed = env_differences(spare.env, env)
        return f"environment changed since the spare started: {', '.join(changed[:5])}" if changed else ""

    def _drop(self, spare: Spare, why: str, kind: str = "spare_not_used") -> None:
        """Discard one spare, saying why; one the kernel killed ends the reserve for the run."""
        if spare in self.pool:
            self.pool.remove(spare)
        killed = spare.proc is not None and spare.proc.poll() == -signal.SIGKILL
        spare.discard()
        self.event(kind, why=why)
        if killed and self.reserve:
            self.reserve = False
            self.event("spare_reserve_off", why="a spare was killed while it waited")

    def after_failure(self, kind: FailureKind, sig: int | None) -> None:
        """The kernel's OOM killer ended the worker: memory shared with the spares ran out, so every later
        attempt starts cold (RLIMIT_AS or --memory-limit on the worker's cgroup are the worker's alone)."""
        if self.enabled and kind is FailureKind.HOST_OOM and sig == signal.SIGKILL:
            self.enabled = False
            had_spares = bool(self.pool) or self._command is not None  # none for a launcher's command
            self.discard()
            if had_spares:
                self.event("spare_off",
                            why="the kernel's OOM killer ended the worker: a spare would hold memory it needs")

    def turn_off(self) -> None:
        """A spare's handover failed an attempt: every later one starts cold, as with --no-spare."""
        self.enabled = False
        self._command = None
        self.discard()

    def discard(self) -> None:
        pool, self.pool = self.pool, []
        for spare in pool:
            spare.discard()
