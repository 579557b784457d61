"""oomguard's worker library: a training session that survives OOMs inside the process.

    from worker import Session, SessionConfig
    with Session(model, optimizer, loss_fn, SessionConfig(global_batch=256, checkpoint_dir="ckpt")) as s:
        for batch in s.batches(dataset):
            s.step(batch)

See README ("The worker library") for the whole API.
"""

from __future__ import annotations

from worker.batching import Tuner, shrink
from worker.checkpoint import CheckpointError, CheckpointStore, load
from worker.oom import classify
from worker.sampler import ResumableSampler
from worker.session import OutOfMemoryAbort, Session, SessionConfig, StepResult

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "OutOfMemoryAbort",
    "ResumableSampler",
    "Session",
    "SessionConfig",
    "StepResult",
    "Tuner",
    "classify",
    "load",
    "shrink",
]
