"""Which launcher starts the ranks: torchrun, ``accelerate launch``, or none (one process).

Tested in tests/unit/supervisor/test_command.py and tests/e2e/test_torchrun.py.

Both launchers are read for the same facts (``Shape``: processes per node, nodes, this node's rank,
the rendezvous) and both give each attempt's argv with the ranks' error files under the run
directory and no restarts of their own. oomguard's own options (``--nproc-per-node``, ``--nnodes``,
``--node-rank``, ``--rdzv-endpoint``) wrap a plain command in torchrun; given beside a launcher's
command they must agree with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from oomguard.supervisor.distributed import accelerate, torchrun
from oomguard.supervisor.distributed.accelerate import AccelerateLaunch
from oomguard.supervisor.distributed.torchrun import Shape, Torchrun
from oomguard.supervisor.lifecycle import UsageError

Launch = Torchrun | AccelerateLaunch


def parse(command: Sequence[str]) -> Launch | None:
    """The launcher line COMMAND starts with, or None for a plain command."""
    return torchrun.parse(command) or accelerate.parse(command)


def shape_of(command: Sequence[str], nproc_per_node: int | None, nnodes: int | None, node_rank: int | None,
             rdzv_endpoint: str | None) -> tuple[Shape | None, Launch | None]:
    """The world's shape (None: one process) and the launcher line each attempt is built from."""
    launch = accelerate.parse(command)
    if launch is None:
        return torchrun.shape_of(command, nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    shape = launch.shape or Shape()
    mine = {"--nproc-per-node": (nproc_per_node, shape.nproc_per_node, "--num_processes / --num_machines"),
            "--nnodes": (nnodes, shape.nnodes, "--num_machines"),
            "--node-rank": (node_rank, shape.node_rank, "--machine_rank"),
            "--rdzv-endpoint": (rdzv_endpoint, shape.rdzv_endpoint, "--main_process_ip:port")}
    for option, (value, theirs, source) in mine.items():
        if value is not None and value != theirs:
            raise UsageError(option, f"{value} disagrees with accelerate launch's {theirs} ({source})",
                             "give it once, in the accelerate launch command (or its config file)")
    return launch.shape, launch


def attempt_argv(shape: Shape, rendered: Sequence[str], log_dir: Path, rdzv_id: str | None,
                 nnodes: int | None = None) -> list[str]:
    """One attempt's launcher argv, from the COMMAND with its placeholders filled: the user's own
    launcher line, or torchrun around a plain command. ``nnodes``: this round's nodes of an elastic
    run (only torchrun's own ``--nnodes MIN:MAX`` is elastic)."""
    launch = parse(rendered) or torchrun.wrap(rendered, shape)
    if isinstance(launch, Torchrun):
        return launch.attempt_argv(log_dir, rdzv_id, nnodes)
    return launch.attempt_argv(log_dir, rdzv_id)


def program(command: Sequence[str]) -> tuple[str, ...] | None:
    """The Python program the command runs, as ``python`` is given it (``("train.py", args...)`` or
    ``("-m", "pkg", args...)``), behind any launcher; None when it runs no Python file of its own."""
    launch = parse(command)
    if launch is not None:
        return launch.program or None
    if command and Path(command[0]).name.startswith("python") and len(command) >= 2:
        return tuple(command[1:])
    return None
