"""Finding the newest valid checkpoint on a real filesystem."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from oomguard.supervisor.observe.checkpoints import SAVE, CheckpointIndex, StepEvidence, scan, step_of


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
