"""oomguard's worker library: a training session that survives OOMs inside the process.

    from oomguard import Session, SessionConfig
    with Session(model, optimizer, loss_fn, SessionConfig(global_batch=256, checkpoint_dir="ckpt")) as s:
        for batch in s.batches(dataset):
            s.step(batch)

See README ("The worker library") for the whole API.

The names are imported on first use (PEP 562): the supervisor imports ``worker.protocol`` and must
not pay for importing torch (about 1 s and 200 MB of RSS).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomguard.worker.batching import Tuner, shrink
    from oomguard.worker.checkpoint import CheckpointError, CheckpointStore, load
    from oomguard.worker.oom import classify
    from oomguard.worker.sampler import ResumableSampler
    from oomguard.worker.session import OutOfMemoryAbort, Session, SessionConfig, StepResult

_WHERE = {
    "Tuner": "batching", "shrink": "batching",
    "CheckpointError": "checkpoint", "CheckpointStore": "checkpoint", "load": "checkpoint",
    "classify": "oom", "ResumableSampler": "sampler",
    "OutOfMemoryAbort": "session", "Session": "session", "SessionConfig": "session", "StepResult": "session",
}

__all__ = [
    "CheckpointError", "CheckpointStore", "OutOfMemoryAbort", "ResumableSampler", "Session", "SessionConfig",
    "StepResult", "Tuner", "classify", "load", "shrink",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    return getattr(importlib.import_module(f"oomguard.worker.{_WHERE[name]}"), name)
