"""The run journal: survives kill -9 mid-write, and keeps sample storage bounded; ``write_atomic``, the one
writer of unit files, the token, --edit copies and checkpoint requests."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT

from oomguard.supervisor.record.journal import Journal, Retention, SampleRow, rows_to_drop, write_atomic

WRITER = """
import sys, time
from oomguard.supervisor.record.journal import Journal
j = Journal(sys.argv[1])
j.start_attempt(1, 1, {"micro_batch": 8, "grad_accum": 1, "global_batch": 8, "world_size": 1}, None, ["x"], "l")
i = 0
while True:
    i += 1
    j.record_sample(1, {"worker_rss_bytes": i}, time.time(), i, None, i, {"type": "progress", "step": i})
    j.event("tick", 1, i=i)
    if i == 50:
        print("ready", flush=True)
"""


def test_kill9_mid_write_leaves_a_consistent_journal(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    journal = Journal(tmp_path)
    assert journal._query("PRAGMA integrity_check")[0][0] == "ok"
    ticks = journal.events(limit=10**6)  # all of them: a quick box writes over events()'s default 1000 in 0.3 s
    assert len(ticks) >= 50
    # every committed tick has its sample: the two were written in order, none half-written
    assert len(journal.samples(max_points=10**6)) in (len(ticks), len(ticks) + 1)
    assert journal.attempts()[0]["last_step"] >= len(ticks) - 1


def test_old_samples_are_thinned_and_peaks_kept(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.start_attempt(1, 1, {"micro_batch": 8, "grad_accum": 1, "global_batch": 8, "world_size": 1}, None,
                          ["x"], "l")
    now = time.time()
    for i in range(3600):  # an hour at 1 Hz, a peak in the middle
        rss = 10_000 if i == 1800 else 100 + i % 7
        journal.record_sample(1, {"worker_rss_bytes": rss}, now - 3600 + i, rss, None, i, None)
    dropped = journal.thin_samples(now)
    left = journal.samples(max_points=10**6)
    assert dropped > 2500 and len(left) < 700
    assert max(s["worker_rss_bytes"] for s in left) == 10_000
    assert len([s for s in left if s["t"] > now - 600]) >= 590  # the last ten minutes at full rate


# --- merged from tests/test_downsample.py -------------------------------------------------------------------
# Sample retention: full rate while recent, per-bucket peaks when old, attempt peaks for ever.


HOUR = 3600.0


def one_hz(attempt: int, start: float, seconds: int, first_id: int = 0) -> list[SampleRow]:
    # A sawtooth so every bucket has a clear maximum; GPU lags host by half a period.
    return [
        SampleRow(first_id + i, attempt, start + i, 1000 + (i % 37), 2000 + ((i + 18) % 37))
        for i in range(seconds)
    ]


def test_recent_rows_are_all_kept() -> None:
    rows = one_hz(1, 0.0, 300)
    assert rows_to_drop(rows, now=300.0) == []


def test_old_rows_keep_bucket_peaks_and_attempt_peaks() -> None:
    rows = one_hz(1, 0.0, 2 * int(HOUR))
    now = 2 * HOUR
    drop = set(rows_to_drop(rows, now))
    kept = [r for r in rows if r.id not in drop]
    old = [r for r in kept if now - r.t >= 600]
    assert len(old) <= 2 * (now - 600) / 60 + 2  # two per minute at most
    assert all(r.id not in drop for r in rows if now - r.t < 600)
    host_peak = max(r.host_bytes or 0 for r in rows)
    assert any(r.host_bytes == host_peak for r in kept)
    # Each kept old row is the maximum of its minute.
    for r in old:
        minute = [x for x in rows if int(x.t // 60) == int(r.t // 60) and now - x.t >= 600]
        assert r.host_bytes == max(x.host_bytes or 0 for x in minute) or r.gpu_bytes == max(
            x.gpu_bytes or 0 for x in minute
        )


def test_attempt_peaks_survive_the_coarsest_tier() -> None:
    rows = one_hz(1, 0.0, 600) + [SampleRow(10_000, 1, 300.5, 9_999, None)] + one_hz(2, 700.0, 600, 20_000)
    drop = rows_to_drop(rows, now=40 * 86_400.0)
    assert 10_000 not in drop
    attempt2 = [r for r in rows if r.attempt == 2 and r.id not in drop]
    assert {r.host_bytes for r in attempt2} >= {1036} and {r.gpu_bytes for r in attempt2} >= {2036}


def test_thinning_is_idempotent() -> None:
    rows = one_hz(1, 0.0, 3 * int(HOUR))
    now = 3 * HOUR
    first = set(rows_to_drop(rows, now))
    survivors = [r for r in rows if r.id not in first]
    assert rows_to_drop(survivors, now) == []


def test_storage_is_bounded_over_days() -> None:
    # Three days of 1 Hz sampling thinned every hour: rows stay in the low thousands, not 259 200.
    policy = Retention()
    rows: list[SampleRow] = []
    next_id, t = 0, 0.0
    for _ in range(3 * 24):
        rows += one_hz(1, t, 3600, next_id)
        next_id, t = next_id + 3600, t + 3600
        drop = set(rows_to_drop(rows, t, policy))
        rows = [r for r in rows if r.id not in drop]
    bound = 600 + 2 * (86_400 - 600) / 60 + 2 * (2 * 86_400) / 900 + 10
    assert len(rows) < bound


def test_bad_retention() -> None:
    with pytest.raises(ValueError):
        Retention(tiers=((86_400.0, 900.0), (600.0, 60.0)))


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
