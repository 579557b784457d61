"""The checkpoint's own record (HF's ``trainer_state.json``) at the edges mutation testing showed
unpinned (docs/mutation.md): the size cap is inclusive, and a rewritten file is read again whether
only its mtime or only its size changed (the cache is per version of the file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.checkpoints import recorded_step


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
