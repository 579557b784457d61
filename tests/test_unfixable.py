"""Errors no restart can fix (decide/classify.py): read from the output as it streams, then one rule;
then real scripts under the real CLI: a missing module is run twice, a script that does not compile once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import oomguard

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.classify import FailureKind, Fatal, seen
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.lifecycle.states import EXIT_GAVE_UP, EXIT_UNFIXABLE
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.record.journal import Journal

PLAN = Plan(BatchPlan(8, 16, 1))
IMPORT = ["Traceback (most recent call last):", '  File "/w/train.py", line 1, in <module>', "    import wandb",
          "ModuleNotFoundError: No module named 'wandb'"]
COMPILE = ['  File "/w/train.py", line 3', "    x = (", "        ^", "SyntaxError: '(' was never closed"]
USAGE = ["usage: train.py [-h] --batch-size BATCH_SIZE",
         "train.py: error: the following arguments are required: --batch-size"]


def scan(*lines: str) -> OutputScanner:
    s = OutputScanner()
    for line in lines:
        s.feed(line)
    return s


def failure(attempt: int, fatal: Fatal | None, kind: FailureKind = FailureKind.CRASH) -> Failure:
    return Failure(attempt, kind, 8, evidence="exit 1", fatal=fatal)


def test_the_exception_line_is_kept_and_a_script_that_does_not_compile_says_so_alone() -> None:
    assert seen(scan(*IMPORT), 1, progressed=False) == Fatal("ModuleNotFoundError: No module named 'wandb'")
    assert seen(scan(*COMPILE), 1, progressed=False) == Fatal("SyntaxError: '(' was never closed", alone=True)
    # a syntax error in a module the script imports comes under a traceback: two attempts decide
    imported = seen(scan(*IMPORT[:3], '  File "/w/helper.py", line 2', "IndentationError: unexpected indent"), 1, False)
    assert imported == Fatal("IndentationError: unexpected indent")
    assert seen(scan("[rank0]: FileNotFoundError: [Errno 2] No such file or directory: 'data/train.bin'"), 1,
                False) == Fatal("FileNotFoundError: [Errno 2] No such file or directory: 'data/train.bin'")
    assert seen(scan(*USAGE), 2, progressed=False) == Fatal(USAGE[1])
    assert seen(scan(*USAGE), 1, progressed=False) is None  # argparse exits 2; another status is not its usage error
    assert seen(scan(*IMPORT), 1, progressed=True) is None  # after a step: a restart may get past it
    assert seen(scan("  ImportError: quoted, not raised", "ValueError: bad shard"), 1, False) is None


def test_the_same_error_twice_in_a_row_or_once_where_its_class_says_it_ends_the_run() -> None:
    config = PolicyConfig()
    first = failure(1, Fatal("ModuleNotFoundError: No module named 'wandb'"))
    assert decide(first, [], PLAN, config).action is Action.RESTART
    second = failure(2, Fatal("ModuleNotFoundError: No module named 'wandb'"))
    decision = decide(second, [first], PLAN, config)
    assert decision.action is Action.GIVE_UP and decision.unfixable
    assert decision.reason.startswith("ModuleNotFoundError: No module named 'wandb', before the first step in "
                                      "attempts 1 and 2: no restart can fix it")
    alone = decide(failure(1, Fatal("SyntaxError: invalid syntax", alone=True)), [], PLAN, config)
    assert alone.action is Action.GIVE_UP and alone.unfixable and "does not compile" in alone.reason
    # another error, a gap (a planned restart between them), or a memory failure: retried as before
    other = failure(2, Fatal("ImportError: cannot import name 'x'"))
    assert decide(other, [first], PLAN, config).action is Action.RESTART
    assert decide(failure(3, first.fatal), [first], PLAN, config).action is Action.RESTART
    oom = failure(2, first.fatal, FailureKind.CUDA_OOM)
    assert not decide(oom, [first], PLAN, config).unfixable


def test_its_exit_status_is_its_own() -> None:
    assert EXIT_UNFIXABLE not in (0, EXIT_GAVE_UP, 2, 75) and EXIT_UNFIXABLE < 128


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
