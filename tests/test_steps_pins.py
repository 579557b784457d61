"""The step reader's edges that mutation testing showed unpinned (docs/mutation.md): a path in a
line is taken out whichever path character it has, the length cut-off, and Lightning's single-epoch
and accumulated bars."""

from __future__ import annotations

import pytest

from oomguard.supervisor.observe.progress import StepMatcher, StepSeen


@pytest.mark.parametrize("line", [
    "wandb: Find logs at: wandb/run-step 3/logs",  # a slash only
    "metrics in step 3.json",  # a file name only
    "run name lr=3-step=5",  # a name formatted from metrics only
    "logs at C:\\runs\\step 7\\events",  # a Windows path only
])
def test_a_step_inside_a_path_or_a_file_name_is_no_progress(line: str) -> None:
    assert StepMatcher().match(line) is None


def test_a_line_of_2000_characters_is_read_one_longer_is_not() -> None:
    matcher = StepMatcher()
    line = "step 12"
    assert matcher.match(line.ljust(2000)) == StepSeen(12, None)
    assert matcher.match(line.ljust(2001)) is None


def test_a_single_epoch_rich_bar_has_a_total_and_accumulation_keeps_it_whole() -> None:
    bar = "Epoch 0/0  ━━━━━━━━━━╸━━━━━━━━━ 5/8 0:00:04 • 0:00:03 1.69it/s v_num: 0"
    assert StepMatcher().match(bar) == StepSeen(5, 8)
    seen = StepMatcher(batches_per_step=3).match(bar)
    assert seen == StepSeen(1, 2) and isinstance(seen.total, int)
    endless = "Epoch 2/-1  ━━━━━━━━━━╸━━━━━━━━━ 5/8 0:00:04 • 0:00:03 1.69it/s v_num: 0"  # max_epochs=-1
    assert StepMatcher().match(endless) == StepSeen(21, None)
