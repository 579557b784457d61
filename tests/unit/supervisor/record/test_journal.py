"""The run journal: survives kill -9 mid-write, and keeps sample storage bounded."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from support import ROOT

from oomguard.supervisor.record.journal import Journal

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
