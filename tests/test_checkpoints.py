"""Finding the newest valid checkpoint on a real filesystem."""

from __future__ import annotations

import os
import time
from pathlib import Path

from oomguard.supervisor.observe.checkpoints import CheckpointIndex, scan, step_of


def test_step_numbers() -> None:
    assert step_of("out/checkpoint-2000") == 2000
    assert step_of("model_000250.pt") == 250
    assert step_of("ckpt.pt") is None


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
