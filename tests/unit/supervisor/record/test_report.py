"""`oomguard report` on recorded journals: one real run through every failure kind, and a journal
written through the Journal API with a scripted clock for exact time figures."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import oomguard

import oomguard.supervisor.record.journal as journal_module
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.picture import CLOSED_INTERRUPTED
from oomguard.supervisor.record.report import build_report, format_duration, format_report


def test_no_run_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = oomguard("report", "--run-dir", str(tmp_path / "nothing"))
    assert out.returncode == 2 and "no oomguard run" in out.stderr
    assert out.stderr.strip().count("\n") == 0


# --- a journal written through the API, on a scripted clock ----------------------------------------


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def time(self) -> float:
        return self.t


def plan(micro: int, accum: int) -> dict[str, Any]:
    return {"micro_batch": micro, "grad_accum": accum, "global_batch": micro * accum, "world_size": 1}


@pytest.fixture
def scripted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Journal, Clock]]:
    clock = Clock(1000.0)
    monkeypatch.setattr(journal_module, "time", types.SimpleNamespace(time=clock.time))
    journal = Journal(tmp_path)
    journal.set_meta(run_dir=str(tmp_path), started=1000.0)
    yield journal, clock
    journal.close()


def at(clock: Clock, t: float) -> None:
    clock.t = t


def fail(journal: Journal, clock: Clock, attempt: int, t: float, kind: str, action: str, to: tuple[int, int],
         last_step: int | None) -> None:
    at(clock, t)
    reason = f"{kind} at attempt {attempt}: {action} at micro-batch {to[0]}"
    journal.end_attempt(attempt, exit_code=1, kind=kind, evidence=f"{kind} evidence", decision=reason,
                        last_step=last_step)
    journal.event("decision", attempt, action=action, reason=reason, micro_batch=to[0], grad_accum=to[1],
                  kind=kind, evidence=f"{kind} evidence")


def test_scripted_journal_exact_figures(scripted: tuple[Journal, Clock]) -> None:
    journal, clock = scripted
    journal.transition("starting", "starting", "supervisor started", None)
    journal.start_attempt(1, 11, plan(8, 4), None, ["train"], "logs/attempt-1.log")
    at(clock, 1030)
    journal.event("worker_batch", 1, micro_batch=4, grad_accum=8, reason="oom")  # in-process change
    journal.checkpoint_seen("ck/checkpoint-10", 10, 1040.0, 1)
    journal.checkpoint_seen("ck/checkpoint-20", 20, 1055.0, 1)  # turns out truncated
    fail(journal, clock, 1, 1060, "cuda_oom", "restart", (4, 8), last_step=23)
    at(clock, 1065)
    journal.start_attempt(2, 12, plan(4, 8), "ck/checkpoint-20", ["train"], "logs/attempt-2.log")
    fail(journal, clock, 2, 1070, "crash", "restart", (4, 8), last_step=None)
    journal.mark_bad("ck/checkpoint-20", "PytorchStreamReader failed")
    at(clock, 1072)
    journal.start_attempt(3, 13, plan(4, 8), "ck/checkpoint-10", ["train"], "logs/attempt-3.log")
    journal.event("worker_progress", 3, step=35)  # reported; the attempt's end says nothing
    journal.checkpoint_seen("ck/checkpoint-30", 30, 1150.0, 3)
    fail(journal, clock, 3, 1200, "host_oom", "give_up", (4, 8), last_step=None)
    at(clock, 1201)
    journal.transition("recovering", "failed", "cannot shrink below --min-micro-batch 4", 3)
    journal.set_meta(state="failed")

    report = build_report(journal)
    assert report["state"] == "failed" and report["ended"] == 1201 and report["total_s"] == 201
    first, second, third = report["failures"]
    assert (first["lost_s"], first["gap_s"]) == (20, 5)  # its last good checkpoint, then the restart
    assert (second["lost_s"], second["gap_s"]) == (5, 2)  # wrote nothing the next attempt used
    assert (third["lost_s"], third["gap_s"]) == (50, 0)  # gave up: after its own newest checkpoint
    assert report["lost_s"] == 82
    # 23 -> tried 20 (bad) -> resumed 10: 13 steps redone in all; the middle figure is a bound.
    assert [f["steps_lost"] for f in report["failures"]] == [3, 10, None]
    assert report["steps_lost"] == 13 and not report["steps_lost_exact"]
    assert third["last_step"] == 35 and third["resumed_from"] is None
    assert third["decision"]["action"] == "give_up"
    assert [(h["by"], h["micro_batch"]) for h in report["batch_history"]] == [
        ("supervisor", 8), ("worker", 4)]
    assert report["checkpoints"]["bad"] == [
        {"path": "ck/checkpoint-20", "step": 20, "reason": "PytorchStreamReader failed"}]
    assert report["checkpoints"]["newest"]["path"] == "ck/checkpoint-30"
    text = format_report(report)
    assert "1 min 22 s lost (41%)" in text and "give_up: host_oom" in text
    assert "bad: ck/checkpoint-20: PytorchStreamReader failed" in text
    assert "steps lost (redone): at least 13" in text


@pytest.mark.parametrize("closed", [False, True], ids=["left open", "closed by the next supervisor"])
def test_unfinished_run_with_an_interrupted_attempt(scripted: tuple[Journal, Clock], closed: bool) -> None:
    """A supervisor killed mid-attempt leaves no exit; the next session closes the attempt as
    interrupted (at its own start, which is not when the attempt died) and starts another."""
    journal, clock = scripted
    journal.start_attempt(1, 11, plan(8, 1), None, ["train"], "logs/attempt-1.log")
    at(clock, 1010)
    journal.event("worker_progress", 1, step=4)
    at(clock, 1100)
    if closed:
        journal.end_attempt(1, decision=CLOSED_INTERRUPTED)
    journal.start_attempt(2, 12, plan(8, 1), None, ["train"], "logs/attempt-2.log")
    journal.transition("starting", "running", "attempt 2", 2)
    report = build_report(journal)
    assert not report["finished"] and report["ended"] is None and report["total_s"] == 100
    (interrupted,) = report["failures"]
    assert interrupted["kind"] == "interrupted" and interrupted["steps_lost"] == 4
    assert interrupted["lost_s"] == 10 and interrupted["gap_s"] == 90
    assert "not finished" in format_report(report)


@pytest.mark.parametrize("seconds,text", [(4.25, "4.2 s"), (125, "2 min 05 s"), (7260, "2 h 01 min")])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_a_checkpoint_rewritten_or_rotated_away_later_counts_for_the_attempt_that_wrote_it(
        scripted: tuple[Journal, Clock]) -> None:
    """Lightning re-saves the checkpoint it resumed from under the same name during the next attempt,
    and rotation (save_top_k, HF's save_total_limit) deletes it later: the failed attempt still saved
    step 4 at 1030, and only the 5 s after it are lost."""
    journal, clock = scripted
    ckpt = "ckpts/epoch=0-step=4.ckpt"
    journal.start_attempt(1, 11, plan(16, 2), None, ["train"], "logs/attempt-1.log")
    at(clock, 1031)
    journal.checkpoint_seen(ckpt, 4, 1030.0, 1)
    fail(journal, clock, 1, 1035, "host_oom", "restart", (8, 4), last_step=None)
    at(clock, 1036)
    journal.checkpoint_seen(ckpt, 4, 1030.0, None)  # known before attempt 2: not its progress
    journal.start_attempt(2, 12, plan(8, 4), ckpt, ["train"], "logs/attempt-2.log")
    at(clock, 1046)
    assert not journal.checkpoint_seen(ckpt, 4, 1045.0, 2)  # the same step written again: not progress
    journal.checkpoint_seen("ckpts/epoch=1-step=8.ckpt", 8, 1060.0, 2)  # and epoch=0-step=4.ckpt rotated away
    at(clock, 1070)
    journal.end_attempt(2, returncode=0, exit_code=0, decision="finished", last_step=8)
    journal.transition("running", "succeeded", "worker finished (attempt 2)", 2)
    journal.set_meta(state="succeeded")

    (failure,) = build_report(journal)["failures"]
    assert (failure["lost_s"], failure["gap_s"]) == (5.0, 1.0)  # not the whole 35 s of the attempt
    assert failure["last_step"] == 4 and failure["last_step_source"] == "checkpoint"
    assert failure["resumed_from"] == {"path": ckpt, "step": 4} and failure["steps_lost"] == 0
    assert [(w["mtime"], w["attempt"]) for w in journal.checkpoint_writes() if w["path"] == ckpt] == [
        (1030.0, 1), (1045.0, 2)]


def test_a_same_name_rewrite_of_unknown_step_is_reported_as_unknown_not_as_the_old_step(
        scripted: tuple[Journal, Clock]) -> None:
    """nanoGPT rewrites ``out/ckpt.pt``: attempt 1 saved it at step 3, then again just before it died,
    a write first seen at the restart, when no step can be told for it. The next attempt resumed
    from that write: its step is unknown, not the 3 the file held before (a supervisor that reports
    a step it did not see is worse than none)."""
    journal, clock = scripted
    ckpt = "out/ckpt.pt"
    journal.start_attempt(1, 11, plan(16, 2), None, ["train"], "logs/attempt-1.log")
    at(clock, 1031)
    assert journal.checkpoint_seen(ckpt, 3, 1030.0, 1)
    fail(journal, clock, 1, 1040, "host_oom", "restart", (8, 4), last_step=7)
    at(clock, 1041)
    assert journal.checkpoint_seen(ckpt, None, 1039.0, None)  # rewritten at 1039, seen at the restart
    assert [(c["step"], c["mtime"], c["attempt"]) for c in journal.checkpoints()] == [(None, 1039.0, None)]
    journal.start_attempt(2, 12, plan(8, 4), ckpt, ["train"], "logs/attempt-2.log")
    at(clock, 1060)
    journal.end_attempt(2, returncode=0, exit_code=0, decision="finished", last_step=9)
    journal.transition("running", "succeeded", "worker finished (attempt 2)", 2)
    journal.set_meta(state="succeeded")

    doc = build_report(journal)
    (failure,) = doc["failures"]
    assert failure["resumed_from"] == {"path": ckpt, "step": None} and failure["steps_lost"] is None
    assert not doc["steps_lost_exact"]
    assert "a checkpoint of unknown step" in "\n".join(format_report(doc).splitlines())
