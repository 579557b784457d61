"""Which process of the worker's tree is a DataLoader worker: said by the process itself.

At a kernel OOM kill the supervisor names each process of the tree by its last reading (the
trainer, its data-loader workers, anything else). A DataLoader worker looks like any fork of the
trainer from outside; from inside it is the one that runs torch's ``_worker_loop``. The probe wraps
that function (once, at torch's import): the wrapper writes one ``role`` record, then runs it with
the same arguments. DataLoader looks the function up on its module each time it starts a worker, so
fork, spawn and forkserver workers all run the wrapper (pickled by its name under spawn).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ..worker import protocol
from . import channel

_MARK = "_oomguard_role"
DATA_LOADER_WORKER = "data-loader worker"


def install(torch: Any) -> None:
    """Wrap ``torch.utils.data._utils.worker._worker_loop`` (once); a torch without it is left alone."""
    try:
        module = importlib.import_module("torch.utils.data._utils.worker")  # imported by ``import torch``
    except ImportError:
        return
    original = getattr(module, "_worker_loop", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _worker_loop(*args: Any, **kwargs: Any) -> Any:
        channel.emit(protocol.ROLE, role=DATA_LOADER_WORKER)  # never raises: the worker is the program's
        return original(*args, **kwargs)

    setattr(_worker_loop, _MARK, True)
    setattr(module, "_worker_loop", _worker_loop)  # noqa: B010 (the module is torch's: typed as a ModuleType)
