"""lifecycle/outcome.py's ``Pending``: the one value for "restart at the next checkpoint", whatever its reason.

(A file of its own only to keep clear of tests-layout's move of test_outcome.py; it belongs there.)
"""

from __future__ import annotations

from oomguard.supervisor.decide.classify import Verdict
from oomguard.supervisor.lifecycle.outcome import Pending, Stop, ending_of
from oomguard.supervisor.lifecycle.states import Ending, StopReason


def test_the_forecasts_restart_acts_on_the_workers_word_and_keeps_its_reason() -> None:
    pending = Pending(StopReason.PLANNED, "planned restart after the next checkpoint: limit in 40 s")
    assert pending.on_save_record
    assert pending.stop("ck/step-40") == Stop(StopReason.PLANNED, pending.detail)
    assert ending_of(pending.stop(None), Verdict(None, "", None, 0), False) is Ending.PLANNED_RESTART


def test_a_grow_waits_for_the_file_and_names_it_with_its_size() -> None:
    pending = Pending(StopReason.GROW, "--grow: micro-batch 32", 32)
    assert not pending.on_save_record
    stop = pending.stop("ck/step-40")
    assert stop == Stop(StopReason.GROW, "--grow: micro-batch 32 after ck/step-40", 32)
    assert ending_of(stop, Verdict(None, "", None, 143), False) is Ending.GROW
