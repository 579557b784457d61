"""Typed configuration of ``oomguard run``, defined once.

``RunConfig`` is the single definition, in sections (batch, distributed, checkpoints, memory, liveness,
web, notify), each a frozen dataclass: the command-line options, the TOML keys (flat: ``micro_batch``,
not ``batch.micro_batch``) and ``oomguard service``'s options are generated from the fields' metadata,
so a new option is one new field. Values are merged defaults < TOML file < command line, then
validated with messages that name the option and the fix. The training command is read once per
config (``RunConfig.parsed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from oomguard.common.batch import BatchPlan, divisors
from oomguard.common.protocol import signal_name
from oomguard.supervisor.command import Carrier, carrier, check_template, parse_edit, used
from oomguard.supervisor.distributed.launcher import shape_of
from oomguard.supervisor.distributed.torchrun import Shape
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.observe.progress import compile_pattern
from oomguard.supervisor.observe.sampler import Thresholds, parse_fraction
from oomguard.supervisor.ops.notify import parse_target
from oomguard.supervisor.units import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

def _opt(default: Any, flag: str, help: str, parse: Callable[[str], Any] | None = None, **extra: Any) -> Any:
    """An option's field: its default, CLI flag, help, how to parse a string value, and ``key``, its flat
    name (TOML key, argparse dest, journal key) where that is not the field's own (``checkpoints.globs``)."""
    return field(default=default, metadata={"flag": flag, "help": help, "parse": parse, **extra})


def _whole(value: object, least: int) -> int:
    """An integer, strictly: TOML ``true`` would be 1 and ``8.5`` would be 8 under ``int()``."""
    if isinstance(value, bool | float):
        raise ValueError("must be a whole number")
    number = int(str(value))
    if number < least:
        raise ValueError("must be at least 1" if least else "must not be negative")
    return number


_positive = partial(_whole, least=1)
_count = partial(_whole, least=0)


def _fraction(text: str) -> float:
    return parse_fraction(str(text))


def _non_negative(text: str) -> float:
    if isinstance(text, bool):
        raise ValueError("must be a number of seconds")
    value = float(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _signal(text: str) -> str:
    """A signal that may ask for a checkpoint, by its full name (``usr1`` -> ``SIGUSR1``)."""
    name = signal_name(str(text))
    if name is None:
        raise UsageError("--checkpoint-signal", f"unknown signal {text!r}", "use e.g. SIGUSR1 or SIGUSR2")
    if name in ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT", "SIGCONT"):
        # KILL and STOP cannot be handled; TERM and INT mean "stop" to every trainer and to us.
        raise UsageError("--checkpoint-signal", f"{name} cannot ask for a checkpoint",
                         "use a signal the worker handles, e.g. SIGUSR1 or SIGUSR2")
    return name


@dataclass(frozen=True)
class BatchOptions:
    """The batch and how it changes: the start, the global batch kept exact, the floor, growing back."""

    micro_batch: int = _opt(0, "--micro-batch", "micro-batch per process to start with",
        _positive, metavar="N", required=True)
    global_batch: int | None = _opt(None, "--global-batch", "global (effective) batch, kept exact: micro × accum × "
        "world", _positive, metavar="N")
    grad_accum: int | None = _opt(None, "--grad-accum", "gradient accumulation steps to start with (instead of "
        "--global-batch)", _positive, metavar="N")
    allow_smaller_global_batch: bool = _opt(False, "--allow-smaller-global-batch", "for a command that passes "
        "{micro_batch} but no {grad_accum} (the script cannot accumulate): let a memory failure halve the micro-batch "
        "and so the global batch, shown as '= 16 (asked 32)' (without it oomguard refuses to)", None)
    min_micro_batch: int = _opt(1, "--min-micro-batch", "never shrink the micro-batch below this",
        _positive, metavar="N")
    eval_micro_batch: int | None = _opt(None, "--eval-micro-batch", "evaluation batch to start with, for a command "
        "that passes {eval_micro_batch}: after an evaluation-time OOM only it is halved (default: --micro-batch)",
        _positive, metavar="N")
    num_workers: int | None = _opt(None, "--num-workers", "DataLoader workers to start with, for a command that passes "
        "{num_workers}: after a data-loader OOM they are halved before the batch", _count, metavar="N")
    fallback_args: tuple[str, ...] = _opt((), "--fallback-args", "arguments to add, in turn, once the micro-batch is "
        "at its floor, e.g. '--gradient-checkpointing' (repeatable)", str, metavar="ARGS", repeat=True, fragment=True)
    edits: tuple[str, ...] = _opt((), "--edit", "set a key in a config file the command names, in a per-attempt copy "
        "(repeatable; dotted keys, placeholders), e.g. 'configs/x.yaml:train.micro_batch_size={micro_batch}'",
        str, metavar="FILE:KEY=VALUE", repeat=True)
    grow: bool = _opt(False, "--grow", "after a stable period, restart at the next checkpoint with a larger "
        "micro-batch that the memory model predicts fits", None)
    grow_after: float = _opt(600.0, "--grow-after", "seconds of stable running (from the first step, where steps are "
        "known) before --grow tries a larger micro-batch", _non_negative, metavar="SECONDS")
    predict_shrink: bool = _opt(False, "--predict-shrink", "after an OOM, go straight to the size predicted to fit "
        "from how far through the forward it came and the memory held then (the probe's figures), when that is below "
        "what halving would try; a prediction beyond proof: the next attempt checks it and --grow (required) climbs "
        "back", None)


@dataclass(frozen=True)
class DistributedOptions:
    """Ranks and nodes: torchrun's shape, and how long to wait for the other nodes."""

    world_size: int = _opt(1, "--world-size", "number of data-parallel processes", _positive, metavar="N")
    nproc_per_node: int | None = _opt(None, "--nproc-per-node", "ranks on this node: start COMMAND through torchrun "
        "with this many processes (read from a torchrun COMMAND when not given)", _positive, metavar="N")
    nnodes: int | None = _opt(None, "--nnodes", "nodes in the run; every node runs oomguard with the same options",
        _positive, metavar="M")
    node_rank: int | None = _opt(None, "--node-rank", "this node's rank, 0 to M-1; node 0 keeps the shared decision "
        "(optional with a c10d rendezvous: then a node on the endpoint's host keeps it, as c10d picks its store's "
        "host)", int, metavar="R")
    rdzv_endpoint: str | None = _opt(None, "--rdzv-endpoint", "HOST:PORT of torchrun's c10d rendezvous, the same on "
        "every node; oomguard's shared state is on PORT+1", str, metavar="HOST:PORT")
    peer_timeout: float = _opt(300.0, "--peer-timeout", "with --nnodes: seconds to wait for another node's plan or "
        "report before ending with exit code 75", _non_negative, metavar="SECONDS")


@dataclass(frozen=True)
class CheckpointOptions:
    """The checkpoints the worker writes, how a restart resumes from one, and how to ask for one."""

    globs: tuple[str, ...] = _opt((), "--checkpoint", "glob of the checkpoints the worker writes (repeatable)",
        str, metavar="GLOB", repeat=True, key="checkpoints")
    resume_args: str = _opt("", "--resume-args", "arguments appended when a checkpoint exists, e.g. '--resume-from "
        "{checkpoint}'", str, metavar="ARGS", fragment=True)
    resumes_itself: bool = _opt(False, "--resumes-itself", "the script finds its checkpoint by itself (a fixed path it "
        "reads, OOMGUARD_CHECKPOINT): without it, --checkpoint needs {checkpoint}, --resume-args, --edit or the worker "
        "library", None)
    signal: str = _opt("SIGUSR1", "--checkpoint-signal", "signal that asks the worker to checkpoint now",
        _signal, metavar="SIG", key="checkpoint_signal")


@dataclass(frozen=True)
class MemoryOptions:
    """The memory budget, the thresholds that act before a crash, and sampling."""

    memory_limit: int | None = _opt(None, "--memory-limit", "host memory budget of the worker's process tree, e.g. 16G",
        parse_size, metavar="SIZE")
    soft_threshold: float = _opt(0.95, "--soft-threshold", "ask the worker to checkpoint when memory passes this "
        "fraction of its budget (GPU, --memory-limit or cgroup), e.g. 0.95 or 95%", _fraction, metavar="FRACTION")
    psi_threshold: float | None = _opt(None, "--psi-threshold", "also ask for a checkpoint when memory pressure (PSI "
        "some avg10, percent) passes this", float, metavar="PERCENT")
    sample_interval: float = _opt(1.0, "--sample-interval", "seconds between memory samples",
        _non_negative, metavar="SECONDS")
    settle_timeout: float = _opt(50.0, "--settle-timeout", "before a restart, seconds to wait for the last attempt's "
        "GPU memory to be freed (its leftover processes are ended first)", _non_negative, metavar="SECONDS")


    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.soft_threshold, self.psi_threshold, self.memory_limit)


@dataclass(frozen=True)
class LivenessOptions:
    """Progress, hangs, stopping a worker, and restarts after crashes."""

    progress_pattern: str = _opt("", "--progress-pattern", "regular expression for the step in the worker's output, "
        "with a named group 'step' and optionally 'total', e.g. 'it (?P<step>\\d+)/(?P<total>\\d+)' (built in: "
        "nanoGPT, Hugging Face, Lightning, tqdm, 'step N')", str, metavar="REGEX", fragment=True)
    hang_timeout: float = _opt(1800.0, "--hang-timeout", "seconds without output or progress, with the worker's "
        "processes and GPUs idle, before it counts as hung (once steps are known, output without a new step is not "
        "progress; 0: never)", _non_negative, metavar="SECONDS")
    grace_period: float = _opt(30.0, "--grace-period", "seconds between SIGTERM and SIGKILL when stopping the worker",
        _non_negative, metavar="SECONDS")
    backoff: float = _opt(1.0, "--backoff", "first delay before restarting after a crash; doubles each time",
        _non_negative, metavar="SECONDS")
    max_backoff: float = _opt(60.0, "--max-backoff", "longest delay between restarts", _non_negative, metavar="SECONDS")
    max_restarts: int = _opt(10, "--max-restarts", "restarts allowed after crashes, kills and hangs",
        _count, metavar="N")


@dataclass(frozen=True)
class WebOptions:
    """The dashboard."""

    enabled: bool = _opt(True, "--no-web", "do not start the dashboard", None, key="web")
    host: str = _opt("127.0.0.1", "--host", "dashboard address", str, metavar="H")
    port: int = _opt(8765, "--port", "dashboard port", _count, metavar="P")


@dataclass(frozen=True)
class NotifyOptions:
    """Notifications."""

    targets: tuple[str, ...] = _opt((), "--notify", "tell a service when the run gives up, succeeds, recovers from an "
        "OOM, finds a leak or degrades: an Apprise URL (tgram://, discord://, mailto://, ntfys://, slack://, "
        "json://...) or a plain https:// webhook (repeatable; try one with oomguard notify-test URL)",
        str, metavar="URL", repeat=True, key="notify")




@dataclass(frozen=True)
class RunConfig:
    """Everything ``oomguard run`` needs, in sections; see ``oomguard run --help`` for each option.
    ``RunConfig.of(micro_batch=8, ...)`` builds one from options by their flat names."""

    command: tuple[str, ...] = ()
    batch: BatchOptions = field(default_factory=BatchOptions)
    distributed: DistributedOptions = field(default_factory=DistributedOptions)
    checkpoints: CheckpointOptions = field(default_factory=CheckpointOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    liveness: LivenessOptions = field(default_factory=LivenessOptions)
    web: WebOptions = field(default_factory=WebOptions)
    notify: NotifyOptions = field(default_factory=NotifyOptions)
    log_max_bytes: int | None = _opt(None, "--log-max-bytes", "cap on each attempt's log file, e.g. 100M: the head and "
        "the tail are kept, the middle is cut (default: no cap)", parse_size, metavar="SIZE")
    run_dir: Path = _opt(Path("oomguard-run"), "--run-dir", "directory for the journal, logs and state of this run",
        Path, metavar="DIR")
    spare: bool = _opt(True, "--no-spare", "start every attempt's worker cold, without a spare interpreter that "
        "imported the script's heavy modules while the last attempt ran (only for 'python script.py'; never touches "
        "CUDA)", None)
    probe: bool = _opt(True, "--no-probe", "do not load oomguard's probe into the worker's Python processes (its "
        "sitecustomize on PYTHONPATH, which reports optimizer steps, allocator peaks and OOMs; docs/probe.md)", None)

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("COMMAND", "no training command given",
                             "put it after --, e.g. oomguard run --micro-batch 8 --grad-accum 4 -- python train.py")
        batch = self.batch
        if batch.micro_batch < 1:
            raise UsageError("--micro-batch", "is required", "pass the micro-batch your script starts with")
        self._check_shape()
        if (batch.global_batch is None) == (batch.grad_accum is None):
            raise UsageError("--global-batch", "give exactly one of --global-batch and --grad-accum",
                             "e.g. --global-batch 64 or --grad-accum 8")
        self._check_batch()
        if self.liveness.max_backoff < self.liveness.backoff:
            raise UsageError("--max-backoff", "is below --backoff", "raise --max-backoff")
        if not 0 <= self.web.port <= 65535:
            raise UsageError("--port", f"{self.web.port} is not a TCP port", "use 0-65535 (0: any free port)")
        if (name := _signal(self.checkpoints.signal)) != self.checkpoints.signal:  # the CLI and TOML give the full name
            raise UsageError("--checkpoint-signal", f"write {name}", "its full name")
        if self.memory.sample_interval <= 0:
            raise UsageError("--sample-interval", "must be above 0", "e.g. 1")
        self._check_memory_options()
        self._check_templates()
        self._check_placeholder_options()
        if batch.predict_shrink and not batch.grow:
            raise UsageError("--predict-shrink", "needs --grow: a prediction may go further down than what fits, "
                             "and only --grow climbs back", "add --grow, or leave --predict-shrink out")
        if self.checkpoints.resumes_itself and not self.checkpoints.globs:
            raise UsageError("--resumes-itself", "is given but no --checkpoint is watched",
                             "add --checkpoint GLOB (the files the script writes), or leave --resumes-itself out")
        self._check_accumulation()

    @classmethod
    def of(cls, **values: Any) -> RunConfig:
        """A validated RunConfig from options by their flat names (the TOML keys) and ``command``."""
        parts: dict[str | None, dict[str, Any]] = {}
        for option in options():
            if option.name in values:
                parts.setdefault(option.section, {})[option.field.name] = values[option.name]
        unknown = set(values) - {option.name for option in options()} - {"command"}
        if unknown:
            raise TypeError(f"RunConfig has no option {', '.join(sorted(unknown))}")
        sections = {name: kind(**parts.get(name, {})) for name, kind in _SECTIONS.items()}
        return cls(tuple(values.get("command", ())), **sections, **parts.get(None, {}))

    @cached_property
    def parsed(self) -> CommandFacts:
        """What the training command says, read once per config (a frozen config never changes)."""
        dist = self.distributed
        shape = shape_of(self.command, dist.nproc_per_node, dist.nnodes, dist.node_rank, dist.rdzv_endpoint)[0]
        return CommandFacts(shape, carrier((*self.templates, *self.edit_values)), frozenset(used(self.templates)))

    @property
    def templates(self) -> tuple[str, ...]:
        """The words rendered into an attempt's argv: the command, --resume-args, --fallback-args."""
        return (*self.command, self.checkpoints.resume_args, *self.batch.fallback_args)

    @cached_property
    def edit_values(self) -> tuple[str, ...]:
        """The values --edit writes (they may hold placeholders)."""
        return tuple(parse_edit(spec).value for spec in self.batch.edits)

    @property
    def accumulation(self) -> Carrier:
        """How the command hands the script its accumulation (command.placeholders.carrier)."""
        return self.parsed.accumulation

    @property
    def dist_shape(self) -> Shape | None:
        """The ranks' shape when the worker runs under torchrun (or accelerate launch), else None."""
        return self.parsed.shape

    @property
    def world_size(self) -> int:
        """Data-parallel processes: torchrun's shape where there is one, else --world-size."""
        shape = self.parsed.shape
        return shape.world_size if shape is not None else self.distributed.world_size

    @property
    def may_shrink(self) -> bool:
        """May the micro-batch shrink? Not where the script cannot accumulate, unless allowed."""
        return self.accumulation is not Carrier.NONE or self.batch.allow_smaller_global_batch

    @property
    def initial_eval_micro_batch(self) -> int | None:
        """The evaluation batch the plan starts with; None when the command has no {eval_micro_batch}."""
        if "eval_micro_batch" not in self.parsed.placeholders:
            return None
        return self.batch.eval_micro_batch or self.batch.micro_batch

    @property
    def initial_plan(self) -> BatchPlan:
        batch, world = self.batch, self.world_size
        if self.accumulation is Carrier.NONE:  # accumulation 1 (checked at start): the global batch is micro × world
            real = batch.micro_batch * world
            return BatchPlan(batch.micro_batch, real, world, asked_global=real)
        if batch.global_batch is not None:
            return BatchPlan(batch.micro_batch, batch.global_batch, world)
        assert batch.grad_accum is not None
        return BatchPlan(batch.micro_batch, batch.micro_batch * batch.grad_accum * world, world)

    def to_json(self) -> dict[str, Any]:
        """The options by their flat names (the TOML keys), as the journal has always kept them."""
        data: dict[str, Any] = {"command": self.command}
        for option in options():
            holder = self if option.section is None else getattr(self, option.section)
            data[option.name] = getattr(holder, option.field.name)
        return data | {"world_size": self.world_size, "run_dir": str(self.run_dir)}

    def _check_templates(self) -> None:
        for token in self.templates:
            check_template(token)
        if self.liveness.progress_pattern:
            try:
                compile_pattern(self.liveness.progress_pattern)
            except ValueError as exc:
                raise UsageError("--progress-pattern", str(exc), "see oomguard run --help") from None
        for value in self.edit_values:
            check_template(value)  # the files themselves are checked when the run opens

    def _check_accumulation(self) -> None:
        """A script told no accumulation trains at accumulation 1, whatever the plan says."""
        batch, world = self.batch, self.world_size
        none = self.accumulation is Carrier.NONE
        if batch.allow_smaller_global_batch and not none:
            raise UsageError("--allow-smaller-global-batch", "is given but the command passes the accumulation "
                             "(or the script derives it), so the global batch is kept exact", "leave it out")
        asked = batch.global_batch // world // batch.micro_batch if batch.global_batch else batch.grad_accum
        if none and asked is not None and asked > 1:
            option = "--global-batch" if batch.global_batch is not None else "--grad-accum"
            real = batch.micro_batch * world
            raise UsageError(option, f"needs accumulation {asked} at micro-batch {batch.micro_batch}, but the "
                             f"command passes no {{grad_accum}}: the script would train at a global batch of {real}",
                             f"put {{grad_accum}} where the script takes it, or use --global-batch {real}")

    def _check_placeholder_options(self) -> None:
        """--num-workers and --eval-micro-batch only act through their placeholders."""
        names = self.parsed.placeholders
        if "num_workers" in names and self.batch.num_workers is None:
            raise UsageError("--num-workers", "the command uses {num_workers} but no starting value is given",
                             "pass --num-workers N (the DataLoader workers to start with)")
        for name, value in (("num_workers", self.batch.num_workers), ("eval_micro_batch", self.batch.eval_micro_batch)):
            if value is not None and name not in names:
                flag = "--" + name.replace("_", "-")
                raise UsageError(flag, f"is given but the command does not use {{{name}}}",
                                 f"put {{{name}}} where the script takes it, e.g. {flag} {{{name}}}")

    def _check_shape(self) -> None:
        """Ranks and nodes, from oomguard's options or a torchrun COMMAND; they set the world size."""
        shape = self.dist_shape
        if shape is None:
            return
        if self.distributed.world_size not in (1, shape.world_size):
            raise UsageError("--world-size", f"{self.distributed.world_size} disagrees with {shape.nproc_per_node} "
                             f"ranks × {shape.nnodes} nodes", "leave --world-size out: torchrun's shape sets it")
        if self.batch.grow and shape.nnodes > 1:
            # Growing is decided from this node's memory readings alone and restarts only this node's
            # ranks; the other nodes would wait in a collective for them and then disagree on the plan.
            raise UsageError("--grow", f"cannot be used with --nnodes {shape.nnodes}: each node would decide it "
                             "alone", "leave --grow out; with one node, --grow works under torchrun")

    def _check_batch(self) -> None:
        batch, world = self.batch, self.world_size
        if batch.min_micro_batch > batch.micro_batch:
            raise UsageError("--min-micro-batch", f"{batch.min_micro_batch} is above --micro-batch "
                             f"{batch.micro_batch}", "lower it")
        if batch.global_batch is None:
            return
        if batch.global_batch % world:
            raise UsageError("--global-batch", f"{batch.global_batch} is not divisible by --world-size "
                             f"{world}", "use a multiple of the world size")
        per = batch.global_batch // world
        if batch.micro_batch > per:
            raise UsageError("--micro-batch", f"{batch.micro_batch} is above the per-process batch {per}",
                             f"use at most {per}")
        if per % batch.micro_batch:
            fits = [d for d in divisors(per) if d <= batch.micro_batch][-1]
            raise UsageError("--micro-batch", f"{batch.micro_batch} does not divide the per-process batch "
                             f"{per}, so the global batch would not be exact", f"use {fits}")

    def _check_memory_options(self) -> None:
        for spec in self.notify.targets:
            parse_target(spec)  # a NotifyConfigError: one line naming --notify
        try:
            self.memory.thresholds  # noqa: B018 - built only to be validated
        except ValueError as exc:
            text = str(exc)
            option = text.split()[0] if text.startswith("--") else "--soft-threshold"
            raise UsageError(option, text.removeprefix(option).strip(" :"), "see oomguard run --help") from None


@dataclass(frozen=True)
class CommandFacts:
    """What the training command says, read once: the ranks' shape, the accumulation's carrier, placeholders."""

    shape: Shape | None
    accumulation: Carrier
    placeholders: frozenset[str]


_SECTIONS: dict[str, type[Any]] = {
    "batch": BatchOptions, "distributed": DistributedOptions, "checkpoints": CheckpointOptions,
    "memory": MemoryOptions, "liveness": LivenessOptions, "web": WebOptions, "notify": NotifyOptions,
}


@dataclass(frozen=True)
class Option:
    """One option: a field of a section (or of RunConfig), by its flat name (TOML key, dest, journal key)."""

    section: str | None
    field: dataclasses.Field[Any]
    name: str


def options() -> list[Option]:
    """The options (every field but the command), section by section, in declaration order."""
    out: list[Option] = []
    for f in dataclasses.fields(RunConfig):
        if f.name in _SECTIONS:
            out += [Option(f.name, g, g.metadata.get("key", g.name)) for g in dataclasses.fields(_SECTIONS[f.name])]
        elif "flag" in f.metadata:
            out.append(Option(None, f, f.name))
    return out


def fragment_flags() -> frozenset[str]:
    """Options whose value is a piece of the training command (``--resume-args '--init_from=resume'``)."""
    return frozenset(o.field.metadata["flag"] for o in options() if o.field.metadata.get("fragment"))


def join_fragments(argv: Sequence[str], flags: frozenset[str]) -> list[str]:
    """``--opt VALUE`` -> ``--opt=VALUE`` for the fragment-taking options: argparse reads a separate
    value that starts with ``-`` as an option of its own, but never an explicit ``=VALUE``."""
    out: list[str] = []
    rest = iter(argv)
    for token in rest:
        if token == "--":  # the training command follows: not ours to touch
            return [*out, token, *rest]
        value = next(rest, None) if token in flags else None
        out.append(token if value is None else f"{token}={value}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``oomguard run``'s options from RunConfig; defaults suppressed, so only what is typed beats the TOML."""
    parser.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file")
    for o in options():
        meta = dict(o.field.metadata)
        meta["help"] = meta["help"].replace("%", "%%")  # argparse %-formats help strings
        if meta["parse"] is None:  # a switch: --no-web turns a default-on feature off, --grow one on
            parser.add_argument(meta["flag"], dest=o.name, default=argparse.SUPPRESS, help=meta["help"],
                                action="store_false" if o.field.default else "store_true")
            continue
        parser.add_argument(meta["flag"], dest=o.name, metavar=meta.get("metavar"),
                            action="append" if meta.get("repeat") else "store", default=argparse.SUPPRESS,
                            help=_help_with_default(meta, o.field.default))


def _help_with_default(meta: Mapping[str, Any], default: Any) -> str:
    if meta.get("required"):  # its default only marks "not given"; validation asks for it
        return f"{meta['help']} (required)"
    return f"{meta['help']} (default: {default})" if default not in (None, (), "") else str(meta["help"])


def _convert(o: Option, value: Any, source: str) -> Any:
    meta, parse = o.field.metadata, o.field.metadata["parse"]
    if meta.get("repeat"):
        return tuple(str(v) for v in (value if isinstance(value, list | tuple) else [value]))
    if parse is None:
        if not isinstance(value, bool):
            raise UsageError(o.name, f"{value!r} in {source} is not true or false", "write true or false")
        return value
    if isinstance(value, list | tuple):
        raise UsageError(meta["flag"], f"takes one value, got {value!r} in {source}", "give a single value")
    try:
        return parse(value)
    except UsageError:
        raise  # the parser's own words (--checkpoint-signal)
    except (ValueError, TypeError) as exc:
        hint = meta.get("metavar", "a value")
        raise UsageError(meta["flag"], f"bad value {value!r} in {source} ({exc})", f"expected {hint}") from None


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise UsageError("--config", f"cannot read {path}: {exc.strerror}", "check the path") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError("--config", f"{path} is not valid TOML ({exc})", "fix the file") from None


def build_config(cli: Mapping[str, Any], command: Sequence[str]) -> RunConfig:
    """Merge the TOML file (if any) and the command line into a validated RunConfig."""
    by_name = {o.name: o for o in options()}
    by_key = {**by_name, **{o.field.metadata["flag"].lstrip("-").replace("-", "_"): o for o in options()}}
    merged: dict[str, Any] = {}
    if cli.get("config"):
        path = Path(cli["config"])
        for key, value in load_toml(path).items():
            if key == "command":
                merged["command"] = _toml_command(value, path)
                continue
            o = by_key.get(key.replace("-", "_"))
            if o is None:
                raise UsageError(key, f"unknown key in {path}", "see oomguard run --help for the options")
            merged[o.name] = _convert(o, value, str(path))
    for name, value in cli.items():
        if name in by_name:
            merged[name] = _convert(by_name[name], value, "the command line")
    if command:
        merged["command"] = tuple(command)
    return RunConfig.of(**merged)


def _toml_command(value: Any, path: Path) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise UsageError("command", f"in {path} must be a string or a list of strings", 'e.g. ["python", "train.py"]')
