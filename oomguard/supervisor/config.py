"""Typed configuration of ``oomguard run``, defined once.

``RunConfig`` is the single definition: the command-line options and the TOML keys are generated
from its fields' metadata, so a new option is one new field. Values are merged
defaults < TOML file < command line, then validated with messages that name the option and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.common.batch import BatchPlan, divisors
from oomguard.common.protocol import signal_name
from oomguard.supervisor.command import Carrier, carrier, check_template, used
from oomguard.supervisor.distributed.launcher import shape_of
from oomguard.supervisor.distributed.torchrun import Shape
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.units import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

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
    from oomguard.supervisor.observe.sampler import parse_fraction

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
        "--micro-batch", "micro-batch per process to start with", _positive, metavar="N", required=True))
    global_batch: int | None = field(default=None, metadata=_opt(
        "--global-batch", "global (effective) batch, kept exact: micro × accum × world", _positive,
        metavar="N"))
    grad_accum: int | None = field(default=None, metadata=_opt(
        "--grad-accum", "gradient accumulation steps to start with (instead of --global-batch)",
        _positive, metavar="N"))
    allow_smaller_global_batch: bool = field(default=False, metadata=_opt(
        "--allow-smaller-global-batch", "for a command that passes {micro_batch} but no {grad_accum} (the script "
        "cannot accumulate): let a memory failure halve the micro-batch and so the global batch, shown as "
        "'= 16 (asked 32)' (without it oomguard refuses to)", None))
    world_size: int = field(default=1, metadata=_opt(
        "--world-size", "number of data-parallel processes", _positive, metavar="N"))
    nproc_per_node: int | None = field(default=None, metadata=_opt(
        "--nproc-per-node", "ranks on this node: start COMMAND through torchrun with this many processes "
        "(read from a torchrun COMMAND when not given)", _positive, metavar="N"))
    nnodes: int | None = field(default=None, metadata=_opt(
        "--nnodes", "nodes in the run; every node runs oomguard with the same options", _positive, metavar="M"))
    node_rank: int | None = field(default=None, metadata=_opt(
        "--node-rank", "this node's rank, 0 to M-1; node 0 keeps the shared decision (optional with a c10d "
        "rendezvous: then a node on the endpoint's host keeps it, as c10d picks its store's host)", int, metavar="R"))
    rdzv_endpoint: str | None = field(default=None, metadata=_opt(
        "--rdzv-endpoint", "HOST:PORT of torchrun's c10d rendezvous, the same on every node; oomguard's shared "
        "state is on PORT+1", str, metavar="HOST:PORT"))
    peer_timeout: float = field(default=300.0, metadata=_opt(
        "--peer-timeout", "with --nnodes: seconds to wait for another node's plan or report before ending "
        "with exit code 75", _non_negative, metavar="SECONDS"))
    settle_timeout: float = field(default=50.0, metadata=_opt(
        "--settle-timeout", "before a restart, seconds to wait for the last attempt's GPU memory to be "
        "freed (its leftover processes are ended first)", _non_negative, metavar="SECONDS"))
    min_micro_batch: int = field(default=1, metadata=_opt(
        "--min-micro-batch", "never shrink the micro-batch below this", _positive, metavar="N"))
    checkpoints: tuple[str, ...] = field(default=(), metadata=_opt(
        "--checkpoint", "glob of the checkpoints the worker writes (repeatable)", str,
        metavar="GLOB", repeat=True))
    resume_args: str = field(default="", metadata=_opt(
        "--resume-args", "arguments appended when a checkpoint exists, e.g. '--resume-from {checkpoint}'",
        str, metavar="ARGS", fragment=True))
    resumes_itself: bool = field(default=False, metadata=_opt(
        "--resumes-itself", "the script finds its checkpoint by itself (a fixed path it reads, OOMGUARD_CHECKPOINT): "
        "without it, --checkpoint needs {checkpoint}, --resume-args, --edit or the worker library", None))
    eval_micro_batch: int | None = field(default=None, metadata=_opt(
        "--eval-micro-batch", "evaluation batch to start with, for a command that passes {eval_micro_batch}: "
        "after an evaluation-time OOM only it is halved (default: --micro-batch)", _positive, metavar="N"))
    num_workers: int | None = field(default=None, metadata=_opt(
        "--num-workers", "DataLoader workers to start with, for a command that passes {num_workers}: "
        "after a data-loader OOM they are halved before the batch", _count, metavar="N"))
    fallback_args: tuple[str, ...] = field(default=(), metadata=_opt(
        "--fallback-args", "arguments to add, in turn, once the micro-batch is at its floor, "
        "e.g. '--gradient-checkpointing' (repeatable)", str, metavar="ARGS", repeat=True, fragment=True))
    progress_pattern: str = field(default="", metadata=_opt(
        "--progress-pattern", "regular expression for the step in the worker's output, with a named "
        "group 'step' and optionally 'total', e.g. 'it (?P<step>\\d+)/(?P<total>\\d+)' (built in: nanoGPT, "
        "Hugging Face, Lightning, tqdm, 'step N')", str, metavar="REGEX", fragment=True))
    edits: tuple[str, ...] = field(default=(), metadata=_opt(
        "--edit", "set a key in a config file the command names, in a per-attempt copy (repeatable; "
        "dotted keys, placeholders), e.g. 'configs/x.yaml:train.micro_batch_size={micro_batch}'", str,
        metavar="FILE:KEY=VALUE", repeat=True))
    max_restarts: int = field(default=10, metadata=_opt(
        "--max-restarts", "restarts allowed after crashes, kills and hangs", _count, metavar="N"))
    memory_limit: int | None = field(default=None, metadata=_opt(
        "--memory-limit", "host memory budget of the worker's process tree, e.g. 16G", parse_size,
        metavar="SIZE"))
    hang_timeout: float = field(default=1800.0, metadata=_opt(
        "--hang-timeout", "seconds without output or progress, with the worker's processes and GPUs idle, before "
        "it counts as hung (once steps are known, output without a new step is not progress; 0: never)",
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
        "--grow-after", "seconds of stable running (from the first step, where steps are known) before "
        "--grow tries a larger micro-batch",
        _non_negative, metavar="SECONDS"))
    predict_shrink: bool = field(default=False, metadata=_opt(
        "--predict-shrink", "after an OOM, go straight to the size predicted to fit from how far through the "
        "forward it came and the memory held then (the probe's figures), when that is below what halving would "
        "try; a prediction beyond proof: the next attempt checks it and --grow (required) climbs back", None))
    notify: tuple[str, ...] = field(default=(), metadata=_opt(
        "--notify", "tell a service when the run gives up, succeeds, recovers from an OOM, finds a leak or "
        "degrades: an Apprise URL (tgram://, discord://, mailto://, ntfys://, slack://, json://...) or a plain "
        "https:// webhook (repeatable; try one with oomguard notify-test URL)", str, metavar="URL", repeat=True))
    log_max_bytes: int | None = field(default=None, metadata=_opt(
        "--log-max-bytes", "cap on each attempt's log file, e.g. 100M: the head and the tail are kept, "
        "the middle is cut (default: no cap)", parse_size, metavar="SIZE"))
    run_dir: Path = field(default=Path("oomguard-run"), metadata=_opt(
        "--run-dir", "directory for the journal, logs and state of this run", Path, metavar="DIR"))
    spare: bool = field(default=True, metadata=_opt(
        "--no-spare", "start every attempt's worker cold, without a spare interpreter that imported the "
        "script's heavy modules while the last attempt ran (only for 'python script.py'; never touches CUDA)",
        None))
    probe: bool = field(default=True, metadata=_opt(
        "--no-probe", "do not load oomguard's probe into the worker's Python processes (its sitecustomize on "
        "PYTHONPATH, which reports optimizer steps, allocator peaks and OOMs; docs/probe.md)", None))
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
        self._check_shape()
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
        self._check_progress_pattern()
        from oomguard.supervisor.command import parse_edit

        for spec in self.edits:
            check_template(parse_edit(spec).value)  # the files themselves are checked when the run opens
        self._check_placeholder_options()
        if self.predict_shrink and not self.grow:
            raise UsageError("--predict-shrink", "needs --grow: a prediction may go further down than what fits, "
                             "and only --grow climbs back", "add --grow, or leave --predict-shrink out")
        if self.resumes_itself and not self.checkpoints:
            raise UsageError("--resumes-itself", "is given but no --checkpoint is watched",
                             "add --checkpoint GLOB (the files the script writes), or leave --resumes-itself out")
        self._check_accumulation()

    @property
    def accumulation(self) -> Carrier:
        """How the command hands the script its accumulation (run.accumulation)."""
        from oomguard.supervisor.command import parse_edit

        edits = [parse_edit(spec).value for spec in self.edits]
        return carrier((*self.command, self.resume_args, *self.fallback_args, *edits))

    @property
    def may_shrink(self) -> bool:
        """May the micro-batch go below the one asked for? Not for a script that cannot accumulate
        (its global batch would shrink with it) unless --allow-smaller-global-batch says so."""
        return self.accumulation is not Carrier.NONE or self.allow_smaller_global_batch

    def _check_accumulation(self) -> None:
        """A script told no accumulation trains at accumulation 1, whatever the plan says."""
        none = self.accumulation is Carrier.NONE
        if self.allow_smaller_global_batch and not none:
            raise UsageError("--allow-smaller-global-batch", "is given but the command passes the accumulation "
                             "(or the script derives it), so the global batch is kept exact", "leave it out")
        asked = self.global_batch // self.world_size // self.micro_batch if self.global_batch else self.grad_accum
        if none and asked is not None and asked > 1:
            option = "--global-batch" if self.global_batch is not None else "--grad-accum"
            real = self.micro_batch * self.world_size
            raise UsageError(option, f"needs accumulation {asked} at micro-batch {self.micro_batch}, but the command "
                             f"passes no {{grad_accum}}: the script would train at a global batch of {real}",
                             f"put {{grad_accum}} where the script takes it, or use --global-batch {real}")

    def _check_placeholder_options(self) -> None:
        """--num-workers and --eval-micro-batch only act through their placeholders."""
        names = used((*self.command, self.resume_args, *self.fallback_args))
        if "num_workers" in names and self.num_workers is None:
            raise UsageError("--num-workers", "the command uses {num_workers} but no starting value is given",
                             "pass --num-workers N (the DataLoader workers to start with)")
        for option, name, value in (("--num-workers", "num_workers", self.num_workers),
                                    ("--eval-micro-batch", "eval_micro_batch", self.eval_micro_batch)):
            if value is not None and name not in names:
                flag = name.replace("_", "-")
                raise UsageError(option, f"is given but the command does not use {{{name}}}",
                                 f"put {{{name}}} where the script takes it, e.g. --{flag} {{{name}}}")

    @property
    def initial_eval_micro_batch(self) -> int | None:
        """The evaluation batch the plan starts with; None when the command has no {eval_micro_batch}."""
        names = used((*self.command, self.resume_args, *self.fallback_args))
        return (self.eval_micro_batch or self.micro_batch) if "eval_micro_batch" in names else None

    def _check_shape(self) -> None:
        """Ranks and nodes, from oomguard's options or a torchrun COMMAND; they set --world-size."""
        shape = self.dist_shape
        if shape is None:
            return
        if self.world_size not in (1, shape.world_size):
            raise UsageError("--world-size", f"{self.world_size} disagrees with {shape.nproc_per_node} ranks × "
                             f"{shape.nnodes} nodes", "leave --world-size out: torchrun's shape sets it")
        object.__setattr__(self, "world_size", shape.world_size)
        if self.grow and shape.nnodes > 1:
            # Growing is decided from this node's memory readings alone and restarts only this node's
            # ranks; the other nodes would wait in a collective for them and then disagree on the plan.
            raise UsageError("--grow", f"cannot be used with --nnodes {shape.nnodes}: each node would decide it "
                             "alone", "leave --grow out; with one node, --grow works under torchrun")

    @property
    def dist_shape(self) -> Shape | None:
        """The ranks' shape when the worker runs under torchrun (or accelerate launch), else None."""
        return shape_of(self.command, self.nproc_per_node, self.nnodes, self.node_rank, self.rdzv_endpoint)[0]

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
        from oomguard.supervisor.observe.sampler import Thresholds
        from oomguard.supervisor.ops.notify import parse_target

        for spec in self.notify:
            parse_target(spec)  # a NotifyConfigError: one line naming --notify
        try:
            Thresholds(self.soft_threshold, self.psi_threshold, self.memory_limit)
        except ValueError as exc:
            text = str(exc)
            option = text.split()[0] if text.startswith("--") else "--soft-threshold"
            raise UsageError(option, text.removeprefix(option).strip(" :"), "see oomguard run --help") from None

    def _check_progress_pattern(self) -> None:
        from oomguard.supervisor.observe.progress import compile_pattern

        if self.progress_pattern:
            try:
                compile_pattern(self.progress_pattern)
            except ValueError as exc:
                raise UsageError("--progress-pattern", str(exc), "see oomguard run --help") from None

    def _check_signal(self) -> None:
        name = signal_name(self.checkpoint_signal)
        if name is None:
            raise UsageError("--checkpoint-signal", f"unknown signal {self.checkpoint_signal!r}",
                             "use e.g. SIGUSR1 or SIGUSR2")
        if name in ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT", "SIGCONT"):
            # KILL and STOP cannot be handled; TERM and INT mean "stop" to every trainer and to us.
            raise UsageError("--checkpoint-signal", f"{name} cannot ask for a checkpoint",
                             "use a signal the worker handles, e.g. SIGUSR1 or SIGUSR2")
        object.__setattr__(self, "checkpoint_signal", name)

    @property
    def initial_plan(self) -> BatchPlan:
        if self.accumulation is Carrier.NONE:  # accumulation 1 (checked at start): the global batch is micro × world
            real = self.micro_batch * self.world_size
            return BatchPlan(self.micro_batch, real, self.world_size, asked_global=real)
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


def fragment_flags() -> frozenset[str]:
    """Options whose value is a piece of the training command (``--resume-args '--init_from=resume'``)."""
    return frozenset(f.metadata["flag"] for f in options() if f.metadata.get("fragment"))


def join_fragments(argv: Sequence[str], flags: frozenset[str]) -> list[str]:
    """``--opt VALUE`` -> ``--opt=VALUE`` for the fragment-taking options: argparse reads a separate
    value that starts with ``-`` as an option of its own, but never an explicit ``=VALUE``."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--":  # the training command follows: not ours to touch
            return out + args[i:]
        if token in flags and i + 1 < len(args):
            out.append(f"{token}={args[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


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
                            help=_help_with_default(meta, f.default))


def _help_with_default(meta: Mapping[str, Any], default: Any) -> str:
    if meta.get("required"):  # its default only marks "not given"; validation asks for it
        return f"{meta['help']} (required)"
    return f"{meta['help']} (default: {default})" if default not in (None, (), "") else str(meta["help"])


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
