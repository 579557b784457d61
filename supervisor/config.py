"""Typed configuration of ``oomguard run``, defined once.

``RunConfig`` is the single definition: the command-line options and the TOML keys are generated
from its fields' metadata, so a new option is one new field. Values are merged
defaults < TOML file < command line, then validated with messages that name the option and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.supervisor.decide.batch import BatchPlan, divisors
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.run.placeholders import check_template

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes in a size such as ``512M``, ``1.5GiB``, ``2GB`` or ``1048576`` (binary units)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size")
    number, unit, _ = match.groups()
    value = int(float(number) * 1024 ** _POWERS[unit.lower()])
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return value


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _opt(flag: str, help: str, parse: Callable[[str], Any] | None = None, **extra: Any) -> dict[str, Any]:
    """Field metadata: the CLI flag, its help and how to parse a string value."""
    return {"flag": flag, "help": help, "parse": parse, **extra}


def _whole(value: object) -> int:
    """An integer, strictly: TOML ``true`` would be 1 and ``8.5`` would be 8 under ``int()``."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError("must be a whole number")
    return int(str(value))


def _positive(text: str) -> int:
    value = _whole(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _count(text: str) -> int:
    value = _whole(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _fraction(text: str) -> float:
    from oomguard.supervisor.observe.thresholds import parse_fraction

    return parse_fraction(str(text))


def _non_negative(text: str) -> float:
    if isinstance(text, bool):
        raise ValueError("must be a number of seconds")
    value = float(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


@dataclass(frozen=True)
class RunConfig:
    """Everything ``oomguard run`` needs; see ``oomguard run --help`` for each option."""

    command: tuple[str, ...] = ()
    micro_batch: int = field(default=0, metadata=_opt(
        "--micro-batch", "micro-batch per process to start with", _positive, metavar="N"))
    global_batch: int | None = field(default=None, metadata=_opt(
        "--global-batch", "global (effective) batch, kept exact: micro × accum × world", _positive,
        metavar="N"))
    grad_accum: int | None = field(default=None, metadata=_opt(
        "--grad-accum", "gradient accumulation steps to start with (instead of --global-batch)",
        _positive, metavar="N"))
    world_size: int = field(default=1, metadata=_opt(
        "--world-size", "number of data-parallel processes", _positive, metavar="N"))
    min_micro_batch: int = field(default=1, metadata=_opt(
        "--min-micro-batch", "never shrink the micro-batch below this", _positive, metavar="N"))
    checkpoints: tuple[str, ...] = field(default=(), metadata=_opt(
        "--checkpoint", "glob of the checkpoints the worker writes (repeatable)", str,
        metavar="GLOB", repeat=True))
    resume_args: str = field(default="", metadata=_opt(
        "--resume-args", "arguments appended when a checkpoint exists, e.g. '--resume-from {checkpoint}'",
        str, metavar="ARGS"))
    fallback_args: tuple[str, ...] = field(default=(), metadata=_opt(
        "--fallback-args", "arguments to add, in turn, once the micro-batch is at its floor, "
        "e.g. '--gradient-checkpointing' (repeatable)", str, metavar="ARGS", repeat=True))
    max_restarts: int = field(default=10, metadata=_opt(
        "--max-restarts", "restarts allowed after crashes, kills and hangs", _count, metavar="N"))
    memory_limit: int | None = field(default=None, metadata=_opt(
        "--memory-limit", "host memory budget of the worker's process tree, e.g. 16G", parse_size,
        metavar="SIZE"))
    hang_timeout: float = field(default=1800.0, metadata=_opt(
        "--hang-timeout", "seconds without output or progress before the worker counts as hung",
        _non_negative, metavar="SECONDS"))
    grace_period: float = field(default=30.0, metadata=_opt(
        "--grace-period", "seconds between SIGTERM and SIGKILL when stopping the worker",
        _non_negative, metavar="SECONDS"))
    backoff: float = field(default=1.0, metadata=_opt(
        "--backoff", "first delay before restarting after a crash; doubles each time", _non_negative,
        metavar="SECONDS"))
    max_backoff: float = field(default=60.0, metadata=_opt(
        "--max-backoff", "longest delay between restarts", _non_negative, metavar="SECONDS"))
    checkpoint_signal: str = field(default="SIGUSR1", metadata=_opt(
        "--checkpoint-signal", "signal that asks the worker to checkpoint now", str, metavar="SIG"))
    soft_threshold: float = field(default=0.95, metadata=_opt(
        "--soft-threshold", "ask the worker to checkpoint when memory passes this fraction of its "
        "budget (GPU, --memory-limit or cgroup), e.g. 0.95 or 95%", _fraction, metavar="FRACTION"))
    psi_threshold: float | None = field(default=None, metadata=_opt(
        "--psi-threshold", "also ask for a checkpoint when memory pressure (PSI some avg10, percent) "
        "passes this", float, metavar="PERCENT"))
    sample_interval: float = field(default=1.0, metadata=_opt(
        "--sample-interval", "seconds between memory samples", _non_negative, metavar="SECONDS"))
    grow: bool = field(default=False, metadata=_opt(
        "--grow", "after a stable period, restart at the next checkpoint with a larger micro-batch "
        "that the memory model predicts fits", None))
    grow_after: float = field(default=600.0, metadata=_opt(
        "--grow-after", "seconds of stable running before --grow tries a larger micro-batch",
        _non_negative, metavar="SECONDS"))
    notify: tuple[str, ...] = field(default=(), metadata=_opt(
        "--notify", "webhook for failure, success and recovered OOMs: URL, slack=URL or ntfy=URL "
        "(repeatable)", str, metavar="SPEC", repeat=True))
    log_max_bytes: int | None = field(default=None, metadata=_opt(
        "--log-max-bytes", "cap on each attempt's log file, e.g. 100M: the head and the tail are kept, "
        "the middle is cut (default: no cap)", parse_size, metavar="SIZE"))
    run_dir: Path = field(default=Path("oomguard-run"), metadata=_opt(
        "--run-dir", "directory for the journal, logs and state of this run", Path, metavar="DIR"))
    web: bool = field(default=True, metadata=_opt("--no-web", "do not start the dashboard", None))
    host: str = field(default="127.0.0.1", metadata=_opt(
        "--host", "dashboard address", str, metavar="H"))
    port: int = field(default=8765, metadata=_opt("--port", "dashboard port", _count, metavar="P"))

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("COMMAND", "no training command given",
                             "put it after --, e.g. oomguard run --micro-batch 8 --grad-accum 4 -- python train.py")
        if self.micro_batch < 1:
            raise UsageError("--micro-batch", "is required", "pass the micro-batch your script starts with")
        if (self.global_batch is None) == (self.grad_accum is None):
            raise UsageError("--global-batch", "give exactly one of --global-batch and --grad-accum",
                             "e.g. --global-batch 64 or --grad-accum 8")
        self._check_batch()
        if self.min_micro_batch > self.micro_batch:
            raise UsageError("--min-micro-batch", f"{self.min_micro_batch} is above --micro-batch "
                             f"{self.micro_batch}", "lower it")
        if self.max_backoff < self.backoff:
            raise UsageError("--max-backoff", "is below --backoff", "raise --max-backoff")
        if not 0 <= self.port <= 65535:
            raise UsageError("--port", f"{self.port} is not a TCP port", "use 0-65535 (0: any free port)")
        self._check_signal()
        if self.sample_interval <= 0:
            raise UsageError("--sample-interval", "must be above 0", "e.g. 1")
        self._check_memory_options()
        for token in (*self.command, self.resume_args, *self.fallback_args):
            check_template(token)

    def _check_batch(self) -> None:
        if self.global_batch is None:
            return
        if self.global_batch % self.world_size:
            raise UsageError("--global-batch", f"{self.global_batch} is not divisible by --world-size "
                             f"{self.world_size}", "use a multiple of the world size")
        per = self.global_batch // self.world_size
        if self.micro_batch > per:
            raise UsageError("--micro-batch", f"{self.micro_batch} is above the per-process batch {per}",
                             f"use at most {per}")
        if per % self.micro_batch:
            fits = [d for d in divisors(per) if d <= self.micro_batch][-1]
            raise UsageError("--micro-batch", f"{self.micro_batch} does not divide the per-process batch "
                             f"{per}, so the global batch would not be exact", f"use {fits}")

    def _check_memory_options(self) -> None:
        from oomguard.supervisor.observe.thresholds import Thresholds
        from oomguard.supervisor.ops.notify import parse_webhook

        try:
            Thresholds(self.soft_threshold, self.psi_threshold, self.memory_limit)
            for spec in self.notify:
                parse_webhook(spec)
        except ValueError as exc:
            text = str(exc)
            option = text.split()[0] if text.startswith("--") else "--notify"
            raise UsageError(option, text.removeprefix(option).strip(" :"), "see oomguard run --help") from None

    def _check_signal(self) -> None:
        import signal

        name = self.checkpoint_signal.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if not isinstance(getattr(signal, name, None), signal.Signals):
            raise UsageError("--checkpoint-signal", f"unknown signal {self.checkpoint_signal!r}",
                             "use e.g. SIGUSR1 or SIGUSR2")
        if name in ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT", "SIGCONT"):
            # KILL and STOP cannot be handled; TERM and INT mean "stop" to every trainer and to us.
            raise UsageError("--checkpoint-signal", f"{name} cannot ask for a checkpoint",
                             "use a signal the worker handles, e.g. SIGUSR1 or SIGUSR2")
        object.__setattr__(self, "checkpoint_signal", name)

    @property
    def initial_plan(self) -> BatchPlan:
        if self.global_batch is not None:
            return BatchPlan(self.micro_batch, self.global_batch, self.world_size)
        assert self.grad_accum is not None
        return BatchPlan(self.micro_batch, self.micro_batch * self.grad_accum * self.world_size,
                         self.world_size)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["run_dir"] = str(self.run_dir)
        return data


def options() -> list[dataclasses.Field[Any]]:
    """The fields that are options (all but the command), in declaration order."""
    return [f for f in dataclasses.fields(RunConfig) if "flag" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Generate ``oomguard run``'s options from RunConfig. Defaults are suppressed so that only what
    the user typed overrides the TOML file."""
    parser.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file")
    for f in options():
        meta = dict(f.metadata)
        meta["help"] = meta["help"].replace("%", "%%")  # argparse %-formats help strings
        if meta["parse"] is None:  # a switch: --no-web turns a default-on feature off, --grow one on
            parser.add_argument(meta["flag"], dest=f.name, default=argparse.SUPPRESS, help=meta["help"],
                                action="store_false" if f.default else "store_true")
            continue
        parser.add_argument(meta["flag"], dest=f.name, metavar=meta.get("metavar"),
                            action="append" if meta.get("repeat") else "store", default=argparse.SUPPRESS,
                            help=f"{meta['help']} (default: {f.default})" if f.default not in (None, (), "")
                            else meta["help"])


def _convert(f: dataclasses.Field[Any], value: Any, source: str) -> Any:
    meta = f.metadata
    flag = meta["flag"]
    values = value if isinstance(value, list | tuple) else [value]
    if meta.get("repeat"):
        return tuple(str(v) for v in values)
    if meta["parse"] is None:
        if not isinstance(value, bool):
            raise UsageError(f.name, f"{value!r} in {source} is not true or false", "write true or false")
        return value
    if isinstance(value, list | tuple):
        raise UsageError(flag, f"takes one value, got {value!r} in {source}", "give a single value")
    try:
        return meta["parse"](value if isinstance(value, str) and meta["parse"] is not str else value)
    except (ValueError, TypeError) as exc:
        hint = meta.get("metavar", "a value")
        raise UsageError(flag, f"bad value {value!r} in {source} ({exc})", f"expected {hint}") from None


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise UsageError("--config", f"cannot read {path}: {exc.strerror}", "check the path") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError("--config", f"{path} is not valid TOML ({exc})", "fix the file") from None
    return data


def build_config(cli: Mapping[str, Any], command: Sequence[str]) -> RunConfig:
    """Merge the TOML file (if any) and the command line into a validated RunConfig."""
    by_name = {f.name: f for f in options()}
    by_key = {**by_name, **{f.metadata["flag"].lstrip("-").replace("-", "_"): f for f in options()}}
    merged: dict[str, Any] = {}
    if cli.get("config"):
        path = Path(cli["config"])
        for key, value in load_toml(path).items():
            if key == "command":
                merged["command"] = _toml_command(value, path)
                continue
            f = by_key.get(key.replace("-", "_"))
            if f is None:
                raise UsageError(key, f"unknown key in {path}", "see oomguard run --help for the options")
            merged[f.name] = _convert(f, value, str(path))
    for name, value in cli.items():
        if name in by_name:
            merged[name] = _convert(by_name[name], value, "the command line")
    if command:
        merged["command"] = tuple(command)
    return RunConfig(**merged)


def _toml_command(value: Any, path: Path) -> tuple[str, ...]:
    if isinstance(value, str):
        import shlex

        return tuple(shlex.split(value))
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise UsageError("command", f"in {path} must be a string or a list of strings", 'e.g. ["python", "train.py"]')
