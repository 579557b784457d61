"""oomguard's worker library: a training session that survives OOMs inside the process.

    from oomguard import Session, SessionConfig
    with Session(model, optimizer, loss_fn, SessionConfig(global_batch=256, checkpoint_dir="ckpt")) as s:
        for batch in s.batches(dataset):
            s.step(batch)

See README ("The worker library") for the whole API. This package imports torch; what the supervisor
and the probe share with it (the record protocol, the OOM texts) is in ``oomguard.common``.
"""

from __future__ import annotations

from oomguard.worker.checkpoint import CheckpointError, CheckpointStore, load
from oomguard.worker.data import ResumableSampler
from oomguard.worker.outofmemory import Tuner, classify, shrink
from oomguard.worker.session import OutOfMemoryAbort, Session, SessionConfig, StepResult

__all__ = [
    "CheckpointError", "CheckpointStore", "OutOfMemoryAbort", "ResumableSampler", "Session", "SessionConfig",
    "StepResult", "Tuner", "classify", "load", "shrink",
]
