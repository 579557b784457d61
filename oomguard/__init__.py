"""oomguard: keeps PyTorch training alive through out-of-memory failures.

Two halves under one name:

- ``oomguard run [options] -- COMMAND`` (``oomguard.supervisor``) supervises any training command:
  it classifies each exit, shrinks the micro-batch while keeping the global batch, and resumes from
  the newest valid checkpoint.
- ``from oomguard import Session`` (``oomguard.worker``) is the opt-in library for scripts that want
  recovery inside the process, atomic checkpoints and exact resume.

The three parts live one level down, as real directories: ``oomguard/supervisor/``,
``oomguard/worker/`` and ``oomguard/web/``, so nothing is installed under another project's import
name (``supervisor`` is supervisord's, ``web`` is web.py's).

The worker names below are imported on first use (PEP 562): the supervisor imports this package
and must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:
    from oomguard.worker import (
        CheckpointError,
        CheckpointStore,
        OutOfMemoryAbort,
        ResumableSampler,
        Session,
        SessionConfig,
        StepResult,
        load,
    )

# What a training script needs; the rest of the library is under oomguard.worker.
__all__ = [
    "CheckpointError", "CheckpointStore", "OutOfMemoryAbort", "ResumableSampler", "Session", "SessionConfig",
    "StepResult", "__version__", "load",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("oomguard.worker"), name)
    raise AttributeError(f"module 'oomguard' has no attribute {name!r}")
