"""The checkpoint index's edges that mutation testing showed unpinned (docs/mutation.md).

A real filesystem throughout. Where a test needs to know *when* the index rescans, the watcher is a
quiet stand-in that reports an event only when the test fires it (inotify delivers on its own
thread, whenever it likes); the clock is scripted, as in tests/test_checkpoints.py.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from oomguard.supervisor.observe import checkpoints
from oomguard.supervisor.observe.checkpoints import (
    CheckpointIndex,
    StepEvidence,
    _watch_roots,
    quiet_stop_race,
    renamed_name,
    scan,
)


class QuietObserver:
    """A watcher that reports nothing until the test fires the handler it was given."""

    def __init__(self) -> None:
        self.scheduled: list[tuple[Any, str, bool]] = []
        self.stopped = 0
        self.joined: list[float | None] = []

    def schedule(self, handler: Any, path: str, recursive: bool = False) -> None:
        self.scheduled.append((handler, path, recursive))

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.stopped += 1

    def join(self, timeout: float | None = None) -> None:
        self.joined.append(timeout)

    def fire(self) -> None:
        for handler, _, _ in self.scheduled:
            handler.on_any_event(object())


class Unavailable:
    """A watcher whose start fails as inotify's does when its watches are exhausted."""

    def schedule(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        raise OSError(28, "inotify watch limit reached")


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> QuietObserver:
    observer = QuietObserver()
    monkeypatch.setattr(checkpoints, "Observer", lambda: observer)
    return observer


def names(found: list[checkpoints.Checkpoint]) -> list[str]:
    return [Path(c.path).name for c in found]


def test_a_name_without_a_step_ranks_below_step_zero(tmp_path: Path) -> None:
    (tmp_path / "ckpt-0.pt").write_bytes(b"0")
    (tmp_path / "ckpt-last.pt").write_bytes(b"1")
    later = time.time() + 60  # the stepless one is newer, yet a step number outranks any mtime
    os.utime(tmp_path / "ckpt-last.pt", (later, later))
    assert names(scan(["ckpt-*.pt"], tmp_path)) == ["ckpt-0.pt", "ckpt-last.pt"]


def test_a_directory_checkpoint_is_its_files_total_size_and_newest_mtime(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-5"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"x" * 10)
    (ckpt / "sub" / "optimizer.pt").write_bytes(b"y" * 20)
    newest = time.time() + 100
    os.utime(ckpt / "sub" / "optimizer.pt", (newest, newest))
    (found,) = scan(["checkpoint-*"], tmp_path)
    assert found.size == 30 and found.mtime == pytest.approx(newest)
    (tmp_path / "model_7.pt").write_bytes(b"z" * 7)
    assert scan(["model_*.pt"], tmp_path)[0].size == 7


def test_a_recursive_glob_finds_checkpoints_at_any_depth(tmp_path: Path) -> None:
    deep = tmp_path / "runs" / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "model_3.pt").write_bytes(b"3")
    assert names(scan(["runs/**/model_*.pt"], tmp_path)) == ["model_3.pt"]


def test_the_watched_directory_is_the_deepest_that_exists_above_the_wildcard(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    assert _watch_roots(["out/ckpt-*"], tmp_path) == {str(tmp_path / "out")}
    # not created yet: its nearest existing parent is watched, so its creation is seen
    assert _watch_roots(["out/later/deeper/ckpt-*"], tmp_path) == {str(tmp_path / "out")}
    assert _watch_roots([str(tmp_path / "out" / "*.pt")], Path("/elsewhere")) == {str(tmp_path / "out")}


def test_the_directories_are_each_globs_own_never_the_working_directory(tmp_path: Path) -> None:
    index = CheckpointIndex(["out/ckpt-*", "ckpt-*", "/abs/run/*/model.pt", "runs/checkpoint-*/"], tmp_path)
    assert index.directories() == [tmp_path / "out", Path("/abs/run"), tmp_path / "runs"]
    assert CheckpointIndex(["out/last.pt"], tmp_path).directories() == [tmp_path / "out"]


def test_the_stop_race_is_filtered_once_from_watchdogs_inotify_logger(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("watchdog.observers.inotify")
    # from a logger without the filter: an earlier start in this process may have added it already
    monkeypatch.setattr(logger, "filters", [f for f in logger.filters if not isinstance(f, checkpoints._StopRace)])
    assert not any(isinstance(f, checkpoints._StopRace) for f in logging.getLogger().filters)
    quiet_stop_race()
    quiet_stop_race()
    assert sum(isinstance(f, checkpoints._StopRace) for f in logger.filters) == 1

    def passes(message: str) -> bool:
        return bool(logger.filter(logging.LogRecord(logger.name, logging.ERROR, __file__, 1, message, None, None)))

    assert not passes("InotifyEmitter.queue_events() called when the thread is inactive")
    assert passes("inotify watch limit reached")


def test_watchdogs_rename_warning_alone_is_silenced(tmp_path: Path, quiet: QuietObserver) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CheckpointIndex(["ck-*"], tmp_path).start()
        warnings.warn("Callback with id 7 already exists for watch /x", RuntimeWarning, stacklevel=1)
        warnings.warn("something else", RuntimeWarning, stacklevel=1)
        warnings.warn("Callback with id 7 already exists for watch /x", UserWarning, stacklevel=1)
    assert [(w.category, str(w.message)) for w in caught] == [
        (RuntimeWarning, "something else"), (UserWarning, "Callback with id 7 already exists for watch /x")]


def test_start_names_the_watcher_or_its_absence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert CheckpointIndex([], tmp_path).start() == "none"
    monkeypatch.setattr(checkpoints, "Observer", Unavailable)
    index = CheckpointIndex(["ck-*"], tmp_path)
    try:
        assert index.start() == "PollingObserver"  # inotify failed: polling instead, not nothing
    finally:
        index.stop()
    monkeypatch.setattr(checkpoints, "PollingObserver", Unavailable)
    assert CheckpointIndex(["ck-*"], tmp_path).start() == "rescan"


def test_with_a_watcher_a_rescan_waits_for_its_event(tmp_path: Path, quiet: QuietObserver) -> None:
    now = [0.0]
    index = CheckpointIndex(["ck-*"], tmp_path, clock=lambda: now[0])
    assert index.start() == "QuietObserver"
    assert [(path, recursive) for _, path, recursive in quiet.scheduled] == [(str(tmp_path), True)]
    assert index.refresh() == []
    (tmp_path / "ck-1").write_bytes(b"1")
    assert index.refresh() == []  # nothing changed as far as the watcher knows: no rescan
    quiet.fire()
    assert names(index.refresh()) == ["ck-1"]
    index.stop()
    index.stop()  # stopping twice is harmless
    assert quiet.stopped == 1
    assert quiet.joined[0] is not None and quiet.joined[0] <= 2  # a stuck watcher thread never holds up the stop
    (tmp_path / "ck-2").write_bytes(b"2")
    assert names(index.refresh()) == ["ck-2", "ck-1"]  # stopped: every refresh rescans


def test_without_a_watcher_every_refresh_rescans(tmp_path: Path) -> None:
    now = [0.0]
    index = CheckpointIndex(["ck-*"], tmp_path, clock=lambda: now[0])
    assert index.refresh() == []
    now[0] = 50.0  # nothing settling
    (tmp_path / "ck-1").write_bytes(b"1")
    assert names(index.refresh()) == ["ck-1"]


def test_a_settling_candidate_is_rescanned_until_it_is_still(tmp_path: Path, quiet: QuietObserver) -> None:
    now = [0.0]
    index = CheckpointIndex(["ck-*"], tmp_path, settle=1.0, clock=lambda: now[0])
    index.start()
    (tmp_path / "ck-1").write_bytes(b"a")
    quiet.fire()
    assert index.refresh()[0].size == 1
    now[0] = 0.5  # still settling: rescanned even though the watcher said nothing
    (tmp_path / "ck-1").write_bytes(b"abc")
    assert index.refresh()[0].size == 3
    now[0] = 1.5  # still since 0.5 for exactly `settle`: no longer settling, no rescan
    (tmp_path / "ck-1").write_bytes(b"abcdef")
    assert index.refresh()[0].size == 3
    index.stop()


def test_settled_at_exactly_the_settle_time_and_one_second_by_default(tmp_path: Path) -> None:
    now = [10.0]
    index = CheckpointIndex(["ck-*"], tmp_path, clock=lambda: now[0])
    (tmp_path / "ck-1").write_bytes(b"a")
    assert index.settled() == []
    now[0] = 11.0
    assert names(index.settled()) == ["ck-1"]


def test_with_the_worker_dead_a_checkpoint_the_watcher_has_not_reported_counts(
        tmp_path: Path, quiet: QuietObserver) -> None:
    index = CheckpointIndex(["ck-*"], tmp_path, clock=lambda: 0.0)
    index.start()
    assert index.refresh() == []
    (tmp_path / "ck-1").write_bytes(b"1")  # written just before the worker died; no event yet
    chosen = index.newest(set(), worker_alive=False)
    assert chosen is not None and Path(chosen.path).name == "ck-1"
    index.stop()


def _aged(path: Path, age: float) -> None:
    """``path`` (a file, or a directory and everything in it) last written ``age`` seconds ago."""
    when = time.time() - age
    for inner in path.rglob("*") if path.is_dir() else ():
        os.utime(inner, (when, when))
    os.utime(path, (when, when))


def test_an_epoch_orders_stepless_directories_against_their_mtimes(tmp_path: Path) -> None:
    """accelerate's ``epoch_{n}`` directories: the later epoch is the newer checkpoint even where an
    older one was touched last (a copy, a restore from a backup). The directories' own mtimes are
    set too: a directory's mtime is its newest, and a fresh one would agree with the epochs."""
    for name, age in (("epoch_9", 0), ("epoch_10", 100)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"w")
        _aged(tmp_path / name, age)
    assert [(Path(c.path).name, c.ordinal) for c in scan(["epoch_*"], tmp_path)] == [("epoch_10", 10), ("epoch_9", 9)]


def test_an_epoch_or_save_count_outranks_a_name_without_one_whatever_its_mtime(tmp_path: Path) -> None:
    """``model_0.pth`` (torchvision's epoch 0) and accelerate's ``checkpoint_1`` rank above
    ``last.pth``, which names no number, even when ``last.pth`` was written after them; and a mix
    of names with an ordinal and without one sorts (no None is ever compared)."""
    for name, age in (("model_0.pth", 100), ("last.pth", 0)):
        (tmp_path / name).write_bytes(b"w")
        _aged(tmp_path / name, age)
    assert [(Path(c.path).name, c.step, c.ordinal) for c in scan(["*.pth"], tmp_path)] == [
        ("model_0.pth", None, 0), ("last.pth", None, None)]
    (tmp_path / "checkpoint_1").mkdir()
    _aged(tmp_path / "checkpoint_1", 200)
    assert names(scan(["checkpoint_*", "*.pth"], tmp_path)) == ["checkpoint_1", "model_0.pth", "last.pth"]


def test_a_checkpoint_without_a_step_says_no_source(tmp_path: Path) -> None:
    """The resume point's ``step_from`` names the evidence of its step: none where there is no step."""
    (tmp_path / "ckpt.pt").write_bytes(b"w")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer_state.json").write_text('{"epoch": 1.0}')
    found = {Path(c.path).name: (c.step, c.step_from) for c in scan(["ckpt.pt", "run"], tmp_path)}
    assert found == {"ckpt.pt": (None, None), "run": (None, None)}


def test_learning_the_step_a_checkpoint_already_has_rescans_nothing(tmp_path: Path, quiet: QuietObserver) -> None:
    """The loop resolves each new checkpoint's step and teaches the index the result; where that is
    the evidence the index already holds (the name said it, no save record beat it), nothing changes,
    so the directory is not rescanned: a checkpoint written since stays unseen until its event."""
    (tmp_path / "ckpt-100.pt").write_bytes(b"w")
    now = [0.0]
    index = CheckpointIndex(["ckpt-*.pt"], tmp_path, clock=lambda: now[0])
    assert index.start() == "QuietObserver"
    (known,) = index.refresh()
    now[0] = 10.0  # settled: only an event or news rescans
    assert (known.step, known.step_from) == (100, "name")
    (tmp_path / "ckpt-200.pt").write_bytes(b"w")  # no event fired yet
    index.learn(known, StepEvidence(100, "name"))
    assert names(index.refresh()) == ["ckpt-100.pt"]
    index.learn(known, StepEvidence(100, "save"))  # the same number from stronger evidence is news
    assert [(Path(c.path).name, c.step_from) for c in index.refresh()] == [("ckpt-200.pt", "name"),
                                                                           ("ckpt-100.pt", "save")]


@pytest.mark.parametrize(("temp", "final"), [
    ("ckpt.pt.tmp", "ckpt.pt"), ("ckpt.pt.tmp3", "ckpt.pt"), (".step_2.pt.tmp", "step_2.pt"), (".step_4.tmp", "step_4"),
    ("tmp-checkpoint-6", "checkpoint-6"), (".tmp-step-1", "step-1"), ("TMP_ckpt.pt", "ckpt.pt"),
    ("step_8-tmp", "step_8"), ("x.pt.partial", "x.pt"), ("x.pt.part", "x.pt"), ("x.incomplete", "x"), ("x.pt~", "x.pt"),
    ("checkpoint-4", None), ("ckpt.pt", None),  # no temp names: nothing renamed them
    ("step_tmpl.pt", None), ("tmp.", None), ("x.lock", None),  # no temp mark at an end, nothing left, a lock
])
def test_the_name_a_temp_is_renamed_to(temp: str, final: str | None) -> None:
    """``renamed_name``: the name without its temp marks, one at each end, else None."""
    assert renamed_name(temp) == final
