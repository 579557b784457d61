"""An error no restart fixes, end to end: a real script that cannot start ends the run with its own status
(the rules are in tests/unit/supervisor/decide/test_classify.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import oomguard

from oomguard.supervisor.lifecycle import EXIT_UNFIXABLE
from oomguard.supervisor.record.journal import Journal


@pytest.mark.parametrize(("source", "attempts"), [
    ("import os\nmicro = os.environ['OOMGUARD_MICRO_BATCH']\nimport no_such_module_xyz\n", 2),
    ("import os\nmicro = os.environ['OOMGUARD_MICRO_BATCH']\nx = (\n", 1),
])
def test_a_real_script_that_cannot_start_ends_the_run_with_its_own_status(tmp_path: Path, source: str,
                                                                           attempts: int) -> None:
    (tmp_path / "train.py").write_text(source)
    out = oomguard("run", "--run-dir", "run", "--no-web", "--backoff", "0.05", "--micro-batch", "8", "--grad-accum",
                   "1", "--", sys.executable, "train.py", cwd=tmp_path, timeout=120)
    assert out.returncode == EXIT_UNFIXABLE, out.stderr
    journal = Journal(tmp_path / "run", readonly=True)
    assert len(journal.attempts()) == attempts
    assert "no restart can fix it" in out.stderr
