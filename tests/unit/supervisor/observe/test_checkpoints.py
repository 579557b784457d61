"""Finding the newest valid checkpoint on a real filesystem."""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from oomguard.supervisor.observe import checkpoints
from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.checkpoints import (
    SAVE,
    CheckpointIndex,
    NameReading,
    StepEvidence,
    _watch_roots,
    quiet_stop_race,
    read_name,
    recorded_step,
    renamed_name,
    scan,
    step_of,
)


def test_step_numbers() -> None:
    assert step_of("out/checkpoint-2000") == 2000
    assert step_of("model_000250.pt") == 250
    assert step_of("ckpt.pt") is None
    assert step_of("out/ckpt_step200_bs16.pt") == 200  # the last number is the batch size


def touch(path: Path, at: float) -> None:
    path.write_bytes(b"x")
    os.utime(path, (at, at))


def test_the_newest_is_the_highest_step_not_the_highest_last_number(tmp_path: Path) -> None:
    """After oomguard halved the batch the newer checkpoint's last number is the smaller one: ordered
    by it, a restart would resume from step 100 and lose the 100 steps since."""
    now = time.time()
    touch(tmp_path / "ckpt_step100_bs32.pt", now - 10)
    touch(tmp_path / "ckpt_step200_bs16.pt", now)
    found = scan(["ckpt_*.pt"], tmp_path)
    assert [(Path(c.path).name, c.step, c.step_from) for c in found] == [
        ("ckpt_step200_bs16.pt", 200, "name"), ("ckpt_step100_bs32.pt", 100, "name")]


def test_a_number_that_is_no_step_orders_nothing_and_an_epoch_orders_its_own(tmp_path: Path) -> None:
    now = time.time()
    for name, age in (("last-v1.ckpt", 0), ("last-v3.ckpt", 10)):  # Lightning's versions: by mtime
        touch(tmp_path / name, now - age)
    assert [Path(c.path).name for c in scan(["last*.ckpt"], tmp_path)] == ["last-v1.ckpt", "last-v3.ckpt"]
    for name, age in (("epoch_9", 0), ("epoch_10", 10)):  # epoch 10 is later, whatever the mtimes say
        (tmp_path / name).mkdir()
        touch(tmp_path / name / "model.safetensors", now - age)
    found = scan(["epoch_*"], tmp_path)
    assert [(Path(c.path).name, c.step, c.ordinal) for c in found] == [("epoch_10", None, 10), ("epoch_9", None, 9)]


def test_hf_trainer_state_gives_the_step_before_the_name(tmp_path: Path) -> None:
    """A Trainer subclass that names checkpoints by epoch still records ``global_step``; a
    ``trainer_state.json`` that is unreadable or says no step leaves the name to speak."""
    for name, state in (("checkpoint-3", '{"global_step": 1200, "epoch": 3.0}'), ("checkpoint-500", "{oops"),
                        ("checkpoint-600", '{"global_step": true}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(state)
    found = {Path(c.path).name: (c.step, c.step_from) for c in scan(["checkpoint-*"], tmp_path)}
    assert found == {"checkpoint-3": (1200, "trainer_state"), "checkpoint-500": (500, "name"),
                     "checkpoint-600": (600, "name")}
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 1300}))
    os.utime(tmp_path / "checkpoint-3" / "trainer_state.json", (time.time() + 5, time.time() + 5))
    assert scan(["checkpoint-3"], tmp_path)[0].step == 1300  # a new version of the file is read again


def test_a_learned_step_orders_until_the_file_is_written_again(tmp_path: Path) -> None:
    """The loop teaches the index the probe's step (here a name that counts micro-batches, 4 per
    optimizer step); a rewrite under the same name forgets it."""
    now = time.time()
    touch(tmp_path / "step_800.pt", now - 10)
    touch(tmp_path / "ckpt.pt", now)
    index = CheckpointIndex(["*.pt"], tmp_path)
    first = index.newest(set(), worker_alive=False)
    assert first is not None and Path(first.path).name == "step_800.pt"
    stepless = next(c for c in index.refresh(force=True) if c.path.endswith("ckpt.pt"))
    index.learn(stepless, StepEvidence(250, SAVE))
    index.learn(first, StepEvidence(200, SAVE))
    assert [(Path(c.path).name, c.step, c.step_from) for c in index.refresh()] == [
        ("ckpt.pt", 250, SAVE), ("step_800.pt", 200, SAVE)]
    touch(tmp_path / "ckpt.pt", now + 5)
    assert [(Path(c.path).name, c.step) for c in index.refresh(force=True)] == [("step_800.pt", 200), ("ckpt.pt", None)]
    index.learn(first, StepEvidence(None, None))  # nothing to learn: the name stands
    assert index.refresh(force=True)[0].step == 200


def test_newest_by_step_then_mtime_and_temp_names_skipped(tmp_path: Path) -> None:
    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-100.tmp", ".checkpoint-200"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "w.pt").write_bytes(b"x" * 10)
    found = scan(["checkpoint-*", ".checkpoint-*"], tmp_path)
    assert [Path(c.path).name for c in found] == ["checkpoint-10", "checkpoint-9"]
    (tmp_path / "a.pt").write_bytes(b"1")
    (tmp_path / "b.pt").write_bytes(b"1")
    os.utime(tmp_path / "a.pt", (time.time() + 5, time.time() + 5))
    assert Path(scan(["*.pt"], tmp_path)[0].path).name == "a.pt"


def test_a_growing_checkpoint_is_not_chosen_while_the_worker_runs(tmp_path: Path) -> None:
    """A scripted clock says how long each file has been still (a loaded machine's sleeps could
    oversleep the settle time and let the partial file count)."""
    now = [100.0]
    index = CheckpointIndex(["ck-*"], tmp_path, settle=0.5, clock=lambda: now[0])
    assert index.start() in ("InotifyObserver", "PollingObserver")
    try:
        (tmp_path / "ck-1").write_bytes(b"a")
        assert index.newest(set(), worker_alive=True) is None  # first seen now: not settled yet
        now[0] += 0.6
        assert index.newest(set(), worker_alive=True).path.endswith("ck-1")  # type: ignore[union-attr]
        (tmp_path / "ck-2").write_bytes(b"partial")
        index.refresh(force=True)  # seen at once, whether or not the observer has told us yet
        now[0] += 0.1
        assert index.newest(set(), worker_alive=True).path.endswith("ck-1")  # type: ignore[union-attr]
        assert index.newest(set(), worker_alive=False).path.endswith("ck-2")  # type: ignore[union-attr]
        excluded = {str(tmp_path / "ck-2")}
        assert index.newest(excluded, worker_alive=False).path.endswith("ck-1")  # type: ignore[union-attr]
    finally:
        index.stop()


def test_a_resume_point_rotated_away_falls_back_to_the_newest_that_exists(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_text(str(step))
    index = CheckpointIndex(["checkpoint-*"], tmp_path)
    chosen = index.newest(set(), worker_alive=False)
    assert chosen is not None and chosen.step == 6
    assert index.still_there(chosen, set()) == chosen
    for name in ("checkpoint-6", "checkpoint-4"):  # save_total_limit's rotation, and a bad one below
        for f in (tmp_path / name).iterdir():
            f.unlink()
        (tmp_path / name).rmdir()
    (tmp_path / "checkpoint-8").mkdir()  # newer, but marked bad
    fallback = index.still_there(chosen, {str(tmp_path / "checkpoint-8")})
    assert fallback is not None and fallback.path == str(tmp_path / "checkpoint-2")
    assert index.still_there(None, set()) is None


# --- merged from tests/test_checkpoints_pins.py -------------------------------------------------------------
# The checkpoint index's edges that mutation testing showed unpinned (docs/mutation.md).
#
# A real filesystem throughout. Where a test needs to know *when* the index rescans, the watcher is a
# quiet stand-in that reports an event only when the test fires it (inotify delivers on its own
# thread, whenever it likes); the clock is scripted, as in tests/unit/supervisor/observe/test_checkpoints.py.


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


# --- merged from tests/test_ckptname.py ---------------------------------------------------------------------
# What a checkpoint's name says about its step, on the names real frameworks write.
#
# Each scheme's source is named beside it; a number the name does not label as a step is never one,
# and an epoch or a save count orders the checkpoints of its scheme (``ordinal``) without being one.


@pytest.mark.parametrize("name,step,ordinal", [
    # HF Trainer: f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}" (trainer.py), documented as the step
    ("checkpoint-500", 500, None),
    # DeepSpeed engine.save_checkpoint: tag = f"global_step{self.global_steps}"
    ("global_step1000", 1000, None),
    # Megatron-LM checkpointing.get_checkpoint_name: 'iter_{:07d}'.format(iteration)
    ("iter_0001000", 1000, None),
    # torchtitan CheckpointManager: f"step-{step}"
    ("step-1000", 1000, None),
    # detectron2 PeriodicCheckpointer: "{}_{:07d}".format("model", iteration); and a sole number
    ("model_0004999.pth", 4999, None),
    ("model_000250.pt", 250, None),
    ("ckpt-12.pt", 12, None),
    # Lightning ModelCheckpoint default "{epoch}-{step}" with "=" (CHECKPOINT_EQUALS_CHAR)
    ("epoch=2-step=500.ckpt", 500, 2),
    # ... and its version suffix f"{CHECKPOINT_JOIN_CHAR}v{ver}" on a name that exists: v1 is no step
    ("epoch=0-step=100-v1.ckpt", 100, 0),
    ("last-v1.ckpt", None, None),
    ("last.ckpt", None, None),
    ("epoch=3-val_loss=0.53.ckpt", None, 3),  # a metric in the name: its digits are no step
    # Composer CheckpointSaver default filename 'ep{epoch}-ba{batch}-rank{rank}.pt' (ba: batches = steps)
    ("ep1-ba300-rank0.pt", 300, 1),
    ("latest-rank0.pt", None, None),  # its latest_filename 'latest-rank{rank}.pt': the rank is no step
    # accelerate examples: output_dir = f"epoch_{epoch}" (an epoch); f"step_{overall_step}" (batches seen)
    ("epoch_3", None, 3),
    ("step_800", 800, None),
    # accelerate ProjectConfiguration(automatic_checkpoint_naming=True): f"checkpoint_{self.save_iteration}",
    # a count of save_state calls
    ("checkpoint_4", None, 4),
    # fairseq checkpoint_utils.save_checkpoint: "checkpoint{}{}.pt".format(epoch, suffix) at an epoch's
    # end; "checkpoint_{}_{}{}.pt".format(epoch, updates, suffix) every save_interval_updates
    ("checkpoint7.pt", None, 7),
    ("checkpoint_3_1500.pt", 1500, 3),
    ("checkpoint_best.pt", None, None),
    ("checkpoint_last.pt", None, None),
    # timm CheckpointSaver: '-'.join([save_prefix, str(epoch)]) + '.pth.tar'
    ("checkpoint-7.pth.tar", None, 7),
    ("model_best.pth.tar", None, None),
    # torchvision references/classification/train.py: f"model_{epoch}.pth"
    ("model_7.pth", None, 7),
    ("model_0.pth", None, 0),
    # mmengine CheckpointHook: f'epoch_{runner.epoch + 1}.pth' by epoch, f'iter_{runner.iter + 1}.pth' by iter
    ("epoch_12.pth", None, 12),
    ("iter_500.pth", 500, None),
    # a user's own: the batch size (which oomguard halves) and the learning rate are no step
    ("ckpt_step200_bs16.pt", 200, None),
    ("ckpt_step100_bs32.pt", 100, None),
    ("run_lr1e-4_step30.pt", 30, None),
    ("ckpt_bs32.pt", None, None),
    ("model_seed42.pt", None, None),
    ("ckpt_3_7.pt", None, None),  # several unlabelled numbers: which one is the step is unknown
    ("model_r16.pt", None, None),  # a number glued to a word that is no step's label (LoRA's rank)
    ("resnet50_100.pt", None, None),  # not the sole number
    ("step100_iter200.pt", None, None),  # two steps that disagree
    # nanoGPT's out/ckpt.pt and Keras-style names: no step, or an extension's digit only
    ("ckpt.pt", None, None),
    ("model.weights.h5", None, None),
    ("weights.05-0.42.hdf5", None, None),
])
def test_the_step_a_name_says(name: str, step: int | None, ordinal: int | None) -> None:
    assert read_name(name) == NameReading(step, ordinal)


# --- merged from tests/test_ckptname_pins.py ----------------------------------------------------------------
# What a checkpoint's name says at the edges mutation testing showed unpinned (docs/mutation.md):
# a name that is a number alone (a directory per step, ``checkpoints/1000/``) names its step, and a
# number the checkpoint's own noun gives with ``=`` is a metric's form, never a step.


@pytest.mark.parametrize("name,step", [
    ("1000", 1000),  # a directory per step, named by the step alone
    ("500.pt", 500),
    ("_750.pt", 750),  # a separator and no label: still the name's own number
])
def test_a_number_alone_is_the_step(name: str, step: int) -> None:
    assert read_name(name) == NameReading(step)


@pytest.mark.parametrize("name,step", [
    ("ckpt=12.pt", None),  # "=" is how a metric is written (Lightning's "val_loss=0.53")
    ("model=3.pt", None),
    ("ckpt-12.pt", 12),  # the same noun with "-", "_" or nothing before the number: its own number
    ("ckpt_12.pt", 12),
    ("ckpt12.pt", 12),
    ("ck-100", 100),  # a user's own word for the checkpoint, set apart: the name's number (tests/workers/causes.py)
    ("gpt_2000.pt", 2000),
    ("ck.100", None),  # "." is no separator a word and its number are written with here
    ("bs-32.pt", None),  # words that name something else: their number is no step
    ("rank_0.pt", None),
    ("seed-42.pt", None),
    ("v-1.ckpt", None),
    ("gpt2.pt", None),  # glued: the word's own number
])
def test_the_nouns_number_given_with_equals_is_no_step(name: str, step: int | None) -> None:
    assert read_name(name) == NameReading(step)


# mutmut leaves a module's constants alone: each entry of ckptname's tables, removed one at a time by
# hand (docs/mutation.md), must change a name's reading. One name per entry the corpus lacks.
@pytest.mark.parametrize("name,step,ordinal", [
    # every label of a step
    ("globalstep1000", 1000, None), ("gs-1000.pt", 1000, None), ("steps_1000", 1000, None),
    ("iters_1000.pth", 1000, None), ("it1000.pt", 1000, None), ("iteration_1000.pt", 1000, None),
    ("iterations-1000", 1000, None), ("update_1000.pt", 1000, None), ("updates_1000.pt", 1000, None),
    ("upd1000.pt", 1000, None),
    # every label of an epoch
    ("epochs_3", None, 3),
    # every noun of the checkpoint's own: its sole number
    ("checkpoints-500", 500, None), ("chkpt_500.pt", 500, None), ("ckpts-500", 500, None),
    ("save_500.pt", 500, None), ("saved-500", 500, None), ("snapshot_500.pt", 500, None),
    ("state_500.pt", 500, None), ("weights_500.pt", 500, None),
    # an extension with a digit of its own is no second number
    ("500.h5", 500, None), ("ckpt-200.hdf5", 200, None),
])
def test_each_label_noun_and_digit_bearing_extension(name: str, step: int | None, ordinal: int | None) -> None:
    assert read_name(name) == NameReading(step, ordinal)


# --- merged from tests/test_ckptstep_pins.py ----------------------------------------------------------------
# The checkpoint's own record (HF's ``trainer_state.json``) at the edges mutation testing showed
# unpinned (docs/mutation.md): the size cap is inclusive, and a rewritten file is read again whether
# only its mtime or only its size changed (the cache is per version of the file).


def _state(directory: Path, step: int, size: int | None = None) -> Path:
    """A trainer_state.json saying ``step``, padded with whitespace to ``size`` bytes if given."""
    text = json.dumps({"global_step": step})
    if size is not None:
        text = text[:-1] + " " * (size - len(text)) + "}"
    path = directory / "trainer_state.json"
    path.write_text(text, encoding="utf-8")
    assert size is None or path.stat().st_size == size
    return path


def test_a_record_of_exactly_the_cap_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    cap = ckptstep._STATE_MAX_BYTES
    (tmp_path / "at").mkdir()
    (tmp_path / "over").mkdir()
    _state(tmp_path / "at", 700, size=cap)
    _state(tmp_path / "over", 700, size=cap + 1)
    assert recorded_step(str(tmp_path / "at")) == 700
    assert recorded_step(str(tmp_path / "over")) is None


def test_a_record_rewritten_with_the_same_size_is_read_again(tmp_path: Path) -> None:
    path = _state(tmp_path, 500)
    os.utime(path, ns=(1_000_000_000_000, 1_000_000_000_000))
    assert recorded_step(str(tmp_path)) == 500
    _state(tmp_path, 600)  # the same number of bytes, written later
    os.utime(path, ns=(2_000_000_000_000, 2_000_000_000_000))
    assert recorded_step(str(tmp_path)) == 600


def test_a_record_rewritten_within_the_same_mtime_is_read_again(tmp_path: Path) -> None:
    """A filesystem with a coarse clock (seconds, on some network mounts) can give a file written
    twice in one tick the same mtime: its size still tells the versions apart."""
    path = _state(tmp_path, 500)
    os.utime(path, ns=(1_000_000_000_000, 1_000_000_000_000))
    assert recorded_step(str(tmp_path)) == 500
    _state(tmp_path, 5000)
    os.utime(path, ns=(1_000_000_000_000, 1_000_000_000_000))
    assert recorded_step(str(tmp_path)) == 5000
