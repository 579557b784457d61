"""torchrun as the worker's launcher: read a ``torchrun ...`` COMMAND, or build one for ``--nproc-per-node``.

oomguard never spawns ranks or runs a rendezvous itself: torchrun does both. This module knows its
command line: the options that set the world's shape, and those oomguard adds to every attempt
(``--log-dir``, so each rank's ``error.json`` lands in the run directory; ``--max-restarts 0``, so
the restart decision stays oomguard's). Without ``--node-rank`` (PyTorch's own multi-node form, c10d
numbering the nodes) ``Shape.node_rank`` is None and ``dist.coordination`` picks the store's host.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from oomguard.supervisor.lifecycle import UsageError

MODULE = "torch.distributed.run"
# torchrun's options that take a value, by every spelling it accepts (torch 2.x's get_args_parser);
# everything else before the script is a switch.
_VALUED = {
    "nnodes", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "max-restarts",
    "monitor-interval", "start-method", "event-log-handler", "role", "log-dir", "redirects", "r", "tee", "t",
    "local-ranks-filter", "duplicate-stdout-filters", "duplicate-stderr-filters", "node-rank", "master-addr",
    "master-port", "local-addr", "logs-specs", "numa-binding", "signals-to-handle", "shutdown-timeout",
}
_SWITCHES = {"standalone", "m", "module", "no-python", "run-path", "virtual-local-rank", "h", "help"}


@dataclass(frozen=True)
class Torchrun:
    """A torchrun command line split into its options and the training command after them."""

    launcher: tuple[str, ...]  # ("torchrun",) or (python, "-m", "torch.distributed.run")
    options: tuple[tuple[str, str | None], ...]  # (canonical name, value) in the order given
    script: tuple[str, ...]  # the training script (or module, or binary) and its arguments

    def get(self, name: str) -> str | None:
        return next((value for key, value in reversed(self.options) if key == name), None)

    def has(self, *names: str) -> bool:
        """Whether a switch (stored with the value None, so ``get`` cannot tell) was given."""
        return any(key in names for key, _ in self.options)

    @property
    def nproc_per_node(self) -> int:
        return _count(self.get("nproc-per-node") or "1", "--nproc-per-node")

    @property
    def nnodes(self) -> int:
        """The most nodes (``--nnodes 4``, or MAX of torchrun's elastic ``--nnodes MIN:MAX``)."""
        return self._nodes()[1]

    def _nodes(self) -> tuple[int, int]:
        """The fewest nodes the run may go on with (MIN of ``--nnodes MIN:MAX``, else every node), the most."""
        text = self.get("nnodes") or "1"
        low, colon, high = text.partition(":")
        least, most = _count(low, "--nnodes"), _count(high if colon else low, "--nnodes")
        if least > most:
            raise UsageError("--nnodes", f"{text}: MIN is above MAX", f"use --nnodes {most}:{least}")
        return least, most

    @property
    def node_rank(self) -> int | None:
        """This node's rank; None with several nodes and none given (c10d assigns the ranks)."""
        text = self.get("node-rank")
        if text is None:
            return 0 if self.nnodes == 1 else None
        if not text.lstrip("-").isdigit():
            raise UsageError("--node-rank", f"{text!r} is not a number", "number the nodes from 0, or leave it out")
        return int(text)

    @property
    def rdzv_endpoint(self) -> str | None:
        return self.get("rdzv-endpoint")

    def with_option(self, name: str, value: str | None) -> Torchrun:
        kept = tuple((k, v) for k, v in self.options if k != name)
        return replace(self, options=(*kept, (name, value)))

    def argv(self) -> list[str]:
        out = list(self.launcher)
        for name, value in self.options:
            out += [f"-{name}" if len(name) == 1 else f"--{name}", *([] if value is None else [value])]
        return [*out, *self.script]

    def shape(self) -> Shape:
        least, most = self._nodes()
        return Shape(self.nproc_per_node, most, self.node_rank, self.rdzv_endpoint, least if least < most else None)

    @property
    def program(self) -> tuple[str, ...]:
        """The training program as ``python`` would be given it (``()`` for a ``--no-python`` binary)."""
        if self.has("no-python"):
            return ()
        if self.has("module", "m"):
            return ("-m", *self.script)
        return self.script


def _count(text: str, option: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UsageError(option, f"{text!r} is not a number of processes",
                         "give a number, e.g. --nproc-per-node 4 (oomguard needs the world size to keep the "
                         "global batch exact)")
    return int(text)


def _launcher_length(command: list[str]) -> int:
    """How many leading words of ``command`` start torchrun (0: it is not a torchrun command)."""
    name = Path(command[0]).name if command else ""
    if name == "torchrun":
        return 1
    python = name.startswith("python")
    if python and command[1:3] == ["-m", MODULE]:
        return 3
    return 2 if python and command[1:2] == [f"-m{MODULE}"] else 0


def parse(command: Sequence[str]) -> Torchrun | None:
    """The torchrun command line in ``command``, or None when COMMAND does not start torchrun."""
    command = list(command)
    n = _launcher_length(command)
    if n == 0:
        return None
    options: list[tuple[str, str | None]] = []
    rest = command[n:]
    while rest and rest[0].startswith("-") and rest[0] != "--":
        word = rest.pop(0)
        name, eq, value = word.lstrip("-").partition("=")
        name = name.replace("_", "-")
        if name in _SWITCHES and not eq:
            options.append((name, None))
            continue
        if name not in _VALUED:
            raise UsageError("COMMAND", f"unknown torchrun option {word}", "see torchrun --help")
        if not eq and not rest:
            raise UsageError("COMMAND", f"torchrun option {word} has no value", "give it one")
        options.append((name, value if eq else rest.pop(0)))
    if rest and rest[0] == "--":
        rest.pop(0)
    if not rest:
        raise UsageError("COMMAND", "torchrun is given no training script", "e.g. torchrun --nproc-per-node 2 train.py")
    return Torchrun(tuple(command[:n]), tuple(options), tuple(rest))


@dataclass(frozen=True)
class Shape:
    """The world oomguard supervises: processes per node, nodes, this node's rank, the rendezvous."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int | None = 0  # None: several nodes and no rank given; the rendezvous numbers them
    rdzv_endpoint: str | None = None
    min_nodes: int | None = None  # torchrun's elastic --nnodes MIN:MAX: MIN; None: every node, always

    @property
    def world_size(self) -> int:
        """The world at full strength (every node), the one the asked plan is for."""
        return self.nproc_per_node * self.nnodes

    @property
    def elastic(self) -> bool:
        """May the run go on with fewer nodes than ``nnodes`` (torchrun's ``--nnodes MIN:MAX``)?"""
        return self.min_nodes is not None and self.min_nodes < self.nnodes


def wrap(command: Sequence[str], shape: Shape) -> Torchrun:
    """torchrun around a plain ``python train.py ARGS`` (or ``python -m pkg ARGS``, or a binary)."""
    command = list(command)
    options: list[tuple[str, str | None]] = [("nproc-per-node", str(shape.nproc_per_node)),
                                             ("nnodes", str(shape.nnodes))]
    if shape.nnodes > 1:
        assert shape.rdzv_endpoint is not None
        options += [("rdzv-backend", "c10d"), ("rdzv-endpoint", shape.rdzv_endpoint)]
        if shape.node_rank is not None:
            # node 0's agent hosts the rendezvous store, so it lives exactly as long as node 0's round;
            # without a rank, c10d picks the host itself (the endpoint's host is this machine)
            options += [("node-rank", str(shape.node_rank)),
                        ("rdzv-conf", f"is_host={'true' if shape.node_rank == 0 else 'false'}")]
    else:
        options += [("standalone", None)]  # a free local port for the rendezvous, no clash between runs
    if Path(command[0]).name.startswith("python") and len(command) >= 2:
        script = command[1:]
        if script[0] == "-m" and len(script) >= 2:
            options.append(("module", None))
            script = script[1:]
        elif script[0].startswith("-"):
            raise UsageError("COMMAND", f"python option {script[0]} cannot pass through torchrun",
                             "run the script directly: python train.py ...")
    else:
        options.append(("no-python", None))
        script = command
    return Torchrun((sys.executable, "-m", MODULE), tuple(options), tuple(script))


def attempt_argv(launch: Torchrun, log_dir: Path, rdzv_id: str | None = None, nnodes: int | None = None) -> list[str]:
    """One attempt: error files under ``log_dir``, no restarts of torchrun's own (oomguard decides, with
    a new plan), a rendezvous id per round, and this round's ``nnodes`` of an elastic run, so c10d closes
    the rendezvous with exactly the world the plan is for (not another, at another global batch)."""
    launch = launch.with_option("log-dir", str(log_dir)).with_option("max-restarts", "0")
    if rdzv_id is not None:
        launch = launch.with_option("rdzv-id", rdzv_id)
    if nnodes is not None:
        launch = launch.with_option("nnodes", f"{nnodes}:{nnodes}")
    return launch.argv()


def shape_of(command: Sequence[str], nproc_per_node: int | None, nnodes: int | None, node_rank: int | None,
             rdzv_endpoint: str | None) -> tuple[Shape | None, Torchrun | None]:
    """The world's shape from oomguard's options or a torchrun COMMAND (asked once: both is an error
    unless they agree), and the torchrun command line each attempt is built from."""
    given = parse(command)
    asked = any(v is not None for v in (nproc_per_node, nnodes, node_rank, rdzv_endpoint))
    if given is None and not asked:
        return None, None
    if given is None:
        nodes = nnodes or 1
        shape = Shape(nproc_per_node or 1, nodes, node_rank if node_rank is not None else (0 if nodes == 1 else None),
                      rdzv_endpoint)
        _check(shape)
        return shape, wrap(command, shape)
    given = _merge(given, {"nproc-per-node": nproc_per_node, "nnodes": nnodes, "node-rank": node_rank,
                           "rdzv-endpoint": rdzv_endpoint})
    shape = given.shape()
    if shape.node_rank is None and (given.get("rdzv-backend") or "static") != "c10d":
        # torchrun's default (static) rendezvous makes every node without --node-rank node 0
        raise UsageError("--node-rank", f"is needed with --nnodes {shape.nnodes} and torchrun's "
                         f"{given.get('rdzv-backend') or 'static'} rendezvous",
                         "use --rdzv-backend c10d (the rendezvous then numbers the nodes), or give --node-rank R")
    _check(shape)
    return shape, given


def _merge(given: Torchrun, mine: dict[str, int | str | None]) -> Torchrun:
    """oomguard's options and the torchrun COMMAND's: said once is enough, said twice must agree;
    a value only oomguard was given goes into the COMMAND too, so torchrun runs the same world."""
    for name, value in mine.items():
        if value is None:
            continue
        theirs = given.get(name)
        if theirs is None:
            given = given.with_option(name, str(value))
        elif theirs != str(value):
            raise UsageError(f"--{name}", f"{value} disagrees with the torchrun COMMAND's {theirs}",
                             "give it once, in the COMMAND")
    return given


def _check(shape: Shape) -> None:
    if shape.nnodes > 1 and not shape.rdzv_endpoint:
        raise UsageError("--rdzv-endpoint", f"is needed with --nnodes {shape.nnodes}",
                         "give the rendezvous HOST:PORT, the same on every node")
    if shape.elastic and shape.node_rank is not None:
        # c10d numbers the nodes of each rendezvous itself; a fixed rank cannot survive a smaller world
        raise UsageError("--node-rank", f"is given with the elastic --nnodes {shape.min_nodes}:{shape.nnodes}",
                         "leave it out: c10d's rendezvous numbers the nodes")
    if shape.node_rank is not None and not 0 <= shape.node_rank < shape.nnodes:
        raise UsageError("--node-rank", f"{shape.node_rank} is not in 0..{shape.nnodes - 1}",
                         "number the nodes from 0")
    if shape.rdzv_endpoint is not None:
        host, _, port = shape.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise UsageError("--rdzv-endpoint", f"{shape.rdzv_endpoint!r} is not HOST:PORT",
                             "e.g. node0.cluster:29400")
