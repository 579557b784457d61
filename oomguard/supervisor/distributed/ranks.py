"""One attempt under torchrun (or accelerate launch, which runs torchrun's agent): its argv, the ranks'
error files and output, and the root cause after it.

Tested in tests/e2e/test_torchrun.py and tests/e2e/test_accelerate.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.supervisor.distributed.errorfiles import RankScanner, RootCause, read_error_files, root_cause
from oomguard.supervisor.distributed.launcher import attempt_argv
from oomguard.supervisor.distributed.torchrun import Shape

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


@dataclass
class TorchrunAttempt:
    argv: list[str]
    log_dir: Path  # torchrun's --log-dir for this attempt: <log_dir>/<run>/attempt_0/<local_rank>/error.json
    scanner: RankScanner = field(default_factory=RankScanner)

    @classmethod
    def of(cls, shape: Shape | None, rendered: Sequence[str], log_dir: Path,
           rdzv_id: str | None = None, nnodes: int | None = None) -> TorchrunAttempt | None:
        """For a run with ranks (``shape`` set), the attempt's launcher argv built from the rendered
        COMMAND (a torchrun or accelerate launch line, or a plain command to wrap in torchrun); None
        for a single-process run. ``nnodes``: the nodes in this round of an elastic run."""
        if shape is None:
            return None
        log_dir.mkdir(parents=True, exist_ok=True)
        return cls(attempt_argv(shape, rendered, log_dir, rdzv_id if shape.nnodes > 1 else None, nnodes), log_dir)

    @property
    def agent_error_file(self) -> Path:
        """torchrun's own error file: its ``@record`` copies the root-cause rank's error there."""
        return self.log_dir / "agent-error.json"

    def root_cause(self) -> RootCause | None:
        return root_cause(self.scanner, read_error_files(self.log_dir))
