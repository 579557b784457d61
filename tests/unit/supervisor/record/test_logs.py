"""`oomguard logs`: a real run's attempt logs, and `-f` following a live run across two attempts."""

from __future__ import annotations

import io
import os
from pathlib import Path

from support import oomguard

from oomguard.supervisor.record.logs import CUT_MARKER, GAP, AttemptLog, follow, log_file


def test_no_run_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = oomguard("logs", "--run-dir", str(tmp_path / "nothing"), "-f")
    assert out.returncode == 2 and "no oomguard run" in out.stderr
    assert out.stderr.strip().count("\n") == 0


def _follow_a_capped_log(tmp_path: Path, lines_per_look: int, looks: int) -> tuple[bytes, int]:
    """The real writer (AttemptLog, capped at 8 KiB) writes ``lines_per_look`` numbered lines
    before each look of the real follower; returns what the follower printed and the lines written."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    log = AttemptLog(log_file(run_dir, 1), max_bytes=8192)
    written = 0

    def over() -> str | None:  # follow asks this before each look: write the next lines then
        nonlocal written
        if written >= lines_per_look * looks:
            return "done"
        for _ in range(lines_per_look):
            written += 1
            log.write(f"line {written:06d}\n".encode())
        log.flush()
        return None

    out = io.BytesIO()
    assert follow(run_dir, 1, out, over, poll=0) == "done"
    log.close()
    assert os.path.getsize(log_file(run_dir, 1)) <= 8192 + len(CUT_MARKER)
    return out.getvalue(), written


def numbers(printed: bytes) -> list[int]:
    return [int(line[5:]) for line in printed.decode().splitlines() if line.startswith("line ")]


def test_follow_keeps_its_place_when_a_capped_log_is_compacted(tmp_path: Path) -> None:
    """Each look sees 40 new lines (480 bytes, under the quarter of the cap the writer keeps): the
    log is compacted dozens of times, and every line is printed exactly once, in order."""
    printed, written = _follow_a_capped_log(tmp_path, lines_per_look=40, looks=100)
    assert numbers(printed) == list(range(1, written + 1))
    assert GAP not in printed


def test_a_burst_bigger_than_the_cap_is_marked_not_hidden(tmp_path: Path) -> None:
    printed, written = _follow_a_capped_log(tmp_path, lines_per_look=2000, looks=3)
    seen = numbers(printed)
    assert seen == sorted(set(seen)) and seen[-1] == written  # in order, none twice, up to the newest
    assert len(seen) < written and GAP in printed  # lines were lost to the cap, and it says so
