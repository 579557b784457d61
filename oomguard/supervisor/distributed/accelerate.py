"""``accelerate launch`` as the worker's launcher, read as torchrun is: the world it will start.

Its flags are read with accelerate's own parser (``launch_command_parser``) and its config file
(``--config_file``, else the one ``accelerate config`` wrote) with accelerate's own loader, so every
spelling means here what it means to accelerate; this module only repeats accelerate's choice of
launcher (``commands/launch.py``, 1.x): ``--multi_gpu``, ``--use_fsdp``, ``--use_megatron_lm``,
``--use_deepspeed`` (or that ``distributed_type``) without ``--cpu`` run torchrun's agent with
``--num_processes`` ranks in all, and oomguard adds ``--log_dir`` and ``--max_restarts 0`` as it
does to torchrun; anything else is accelerate's one-process launcher (several CPU processes are
MPI's job, which oomguard does not follow), said at start in one line.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.supervisor.distributed.torchrun import Shape
from oomguard.supervisor.lifecycle import UsageError

MODULE = "accelerate.commands.launch"
DEFAULT_PORT = 29500  # accelerate's main_process_port when none is given
_ELASTIC = ("MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU",
            "MULTI_NEURON", "FSDP", "MEGATRON_LM", "DEEPSPEED")
_SWITCH_FLAGS = ("multi_gpu", "tpu", "tpu_use_cluster", "use_deepspeed", "use_fsdp", "use_megatron_lm")


@dataclass(frozen=True)
class AccelerateLaunch:
    """An ``accelerate launch`` command line: its words split, and the world it starts."""

    launcher: tuple[str, ...]  # ("accelerate", "launch"), ("accelerate-launch",) or (python, "-m", MODULE)
    options: tuple[str, ...]  # the launcher's own words, as given
    script: tuple[str, ...]  # the training script (or module, or binary) and its arguments
    shape: Shape | None  # None: accelerate's simple launcher, one process
    module: bool = False
    no_python: bool = False
    note: str | None = None  # a line to say at start (what accelerate will really start)

    @property
    def program(self) -> tuple[str, ...]:
        """The training program as ``python`` would be given it (``()`` for a binary)."""
        if self.no_python:
            return ()
        return ("-m", *self.script) if self.module else self.script

    def attempt_argv(self, log_dir: Path) -> list[str]:
        """Error files under ``log_dir``, no restarts (accelerate hands both to torchrun; the last of a
        repeated flag wins); no rendezvous id: its static rendezvous starts fresh each round."""
        ours = ("--log_dir", str(log_dir), "--max_restarts", "0") if self.shape is not None else ()
        return [*self.launcher, *self.options, *ours, *self.script]


def launcher_length(command: list[str]) -> int:
    """How many leading words of ``command`` start ``accelerate launch`` (0: it does not)."""
    name = Path(command[0]).name if command else ""
    if name == "accelerate" and command[1:2] == ["launch"]:
        return 2
    if name == "accelerate-launch":
        return 1
    return 3 if name.startswith("python") and command[1:3] == ["-m", MODULE] else 0


def parse(command: Sequence[str], env: Mapping[str, str] | None = None) -> AccelerateLaunch | None:
    """The ``accelerate launch`` line in ``command``, or None when COMMAND does not start it; bad
    flags, a config file that does not load and a shape accelerate cannot run are UsageErrors."""
    command = list(command)
    n = launcher_length(command)
    if n == 0:
        return None
    args = _parse_flags(command[n:])
    tail = 1 + len(args.training_script_args)
    options, script = command[n:len(command) - tail], command[len(command) - tail:]
    config = _config(args, os.environ if env is None else env)
    shape, note = _shape(args, config)
    return AccelerateLaunch(tuple(command[:n]), tuple(options), tuple(script), shape, bool(args.module),
                            bool(args.no_python), note)


def _parse_flags(words: list[str]) -> Any:
    try:
        from accelerate.commands.launch import launch_command_parser
    except ImportError as exc:
        raise UsageError("COMMAND", f"accelerate launch cannot be read: accelerate does not import in oomguard's "
                         f"Python ({exc})", "install oomguard where accelerate is installed") from None
    parser = launch_command_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            return parser.parse_args(words)
    except SystemExit:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        problem = lines[-1].split("error: ", 1)[-1] if lines else "cannot be parsed"
        raise UsageError("COMMAND", f"accelerate launch: {problem}", "see accelerate launch --help") from None


def default_config_file(env: Mapping[str, str]) -> Path:
    """Where ``accelerate config`` writes and ``accelerate launch`` reads its default config."""
    cache = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = env.get("HF_HOME") or os.path.join(cache, "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def _config(args: Any, env: Mapping[str, str]) -> Any:
    """accelerate's config for this launch, as accelerate loads it; None where it reads none (no
    file, or ``--cpu`` without ``--config_file``)."""
    given = args.config_file is not None
    path = Path(args.config_file) if given else default_config_file(env)
    if not given and (args.cpu or not path.is_file()):
        return None
    from accelerate.commands.config.config_args import load_config_from_file

    where = "--config_file" if given else "COMMAND"
    if not path.is_file():
        raise UsageError(where, f"{path} does not exist", "give the file `accelerate config` wrote")
    try:
        return load_config_from_file(str(path))
    except Exception as exc:  # yaml, json, or accelerate's own checks of the keys: each is the same fix
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UsageError(where, f"accelerate's config {path} does not load ({type(exc).__name__}: {first})",
                         "fix it, or write it again with `accelerate config`") from None


def _pick(args: Any, config: Any, name: str, default: Any) -> Any:
    """A flag wins over the config file, which wins over accelerate's default."""
    value = getattr(args, name, None)
    if value is None and config is not None:
        value = getattr(config, name, None)
    return default if value is None else value


def _elastic(args: Any, config: Any) -> bool:
    """Does accelerate start the ranks through torchrun's agent (else: one process)?"""
    if getattr(args, "tpu", False) or _distributed_type(config) == "XLA":
        raise UsageError("COMMAND", "accelerate launch on TPUs is not supervised by oomguard",
                         "run it without oomguard, or on GPUs")
    if getattr(args, "mpirun_hostfile", None) or (config is not None and (config.mpirun_config or {}).get(
            "mpirun_hostfile")):
        raise UsageError("COMMAND", "accelerate's MPI launch (--mpirun_hostfile) starts ranks oomguard cannot "
                         "follow", "for several CPU processes use --multi_gpu with ACCELERATE_USE_CPU=1")
    return not args.cpu and (any(getattr(args, flag, False) for flag in _SWITCH_FLAGS)
                             or _distributed_type(config) in _ELASTIC)


def _distributed_type(config: Any) -> str | None:
    kind = getattr(config, "distributed_type", None)
    return None if kind is None else str(getattr(kind, "value", kind)).upper()


def _shape(args: Any, config: Any) -> tuple[Shape | None, str | None]:
    """The ranks accelerate will start: processes per machine, machines, this machine's rank, the
    rendezvous; None (and what to say) for its one-process launcher."""
    processes = _pick(args, config, "num_processes", None)
    if not _elastic(args, config):
        if processes is not None and int(processes) > 1:
            return None, (f"accelerate launch starts one process here (--num_processes {processes} is for "
                          "its torchrun launch, --multi_gpu; several CPU processes are MPI's), so the world is 1")
        return None, None
    if getattr(args, "use_deepspeed", False) or _distributed_type(config) == "DEEPSPEED":
        _check_deepspeed(args, config)
    if processes is None or int(processes) < 1:
        raise UsageError("COMMAND", "accelerate launch is given no --num_processes (accelerate would count "
                         "the GPUs)", "give --num_processes N (all machines together): oomguard needs the world "
                         "size to keep the global batch exact")
    machines, rank = int(_pick(args, config, "num_machines", 1)), int(_pick(args, config, "machine_rank", 0))
    processes = int(processes)
    if machines < 1 or processes % machines:
        raise UsageError("COMMAND", f"accelerate launch --num_processes {processes} is not a multiple of "
                         f"--num_machines {machines}", "--num_processes counts the processes of all machines")
    if not 0 <= rank < machines:
        raise UsageError("COMMAND", f"accelerate launch --machine_rank {rank} is not in 0..{machines - 1}",
                         "number the machines from 0")
    endpoint = None
    if machines > 1:
        ip = _pick(args, config, "main_process_ip", None)
        if not ip:
            raise UsageError("COMMAND", f"accelerate launch on {machines} machines has no --main_process_ip",
                             "give machine 0's address, the same on every machine")
        endpoint = f"{ip}:{_pick(args, config, 'main_process_port', DEFAULT_PORT)}"
    return Shape(processes // machines, machines, rank, endpoint), None



def _check_deepspeed(args: Any, config: Any) -> None:
    """DeepSpeed on several machines starts its ranks over pdsh/ssh unless told to use torchrun."""
    machines = int(_pick(args, config, "num_machines", 1))
    launcher = _pick(args, config, "deepspeed_multinode_launcher", None)
    if config is not None and launcher is None:
        launcher = (config.deepspeed_config or {}).get("deepspeed_multinode_launcher")
    if machines > 1 and launcher != "standard":
        raise UsageError("COMMAND", f"accelerate launch with DeepSpeed on {machines} machines starts its ranks over "
                         f"{launcher or 'pdsh'}, which oomguard cannot follow",
                         "pass --deepspeed_multinode_launcher standard (torchrun) and run oomguard on every machine")
