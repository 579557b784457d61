"""record.durable.write_atomic: the one writer of unit files, the token, --edit copies and checkpoint requests."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from oomguard.supervisor.record.durable import write_atomic


def test_replaces_content_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "unit.service"
    write_atomic(target, "one\n")
    write_atomic(target, "two\n")
    assert target.read_text() == "two\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["unit.service"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_a_private_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_atomic(tmp_path / "token", "secret\n", 0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600


def test_a_planted_symlink_is_replaced_not_followed(tmp_path: Path) -> None:
    """Someone who can write the run directory links checkpoint.request to a file of ours: writing
    the request must not overwrite that file."""
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    request = tmp_path / "run" / "checkpoint.request"
    request.parent.mkdir()
    request.symlink_to(victim)
    write_atomic(request, "1700000000.0 requested\n")
    assert victim.read_text() == "keep me\n"
    assert not request.is_symlink() and request.read_text() == "1700000000.0 requested\n"
