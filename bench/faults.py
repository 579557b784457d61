"""The long fault campaign: many kill -9s of the supervisor, damaged journals, a full disk.

    .venv/bin/python bench/faults.py [--rounds 3] [--kills 15] [--seed N] [--json]

* ``kill``: ``--rounds`` runs of the campaign in ``tests/e2e/faults/campaign.py`` with ``--kills`` kills
  each (random instants: checkpoint writes, journal writes, restarts), then a restart on the same
  run directory; counted: duplicate workers, workers outliving their supervisor, journals failing
  ``PRAGMA integrity_check``, resumes from anything but the newest valid checkpoint.
* ``journal``: a finished run's journal made garbage, cut in half or emptied, then ``status``,
  ``report``, ``stop``, ``logs`` and ``run`` on it: each must be one line, exit 2, the file untouched.
* ``disk``: a run whose worker fills the 20 MB tmpfs its run directory is on (skipped where tmpfs
  cannot be mounted): the worker must finish, the journal must pass integrity_check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "e2e" / "faults"), str(ROOT)]  # not "faults": that is this file's own name

import campaign  # noqa: E402

RUN = ["--no-web", "--micro-batch", "1", "--grad-accum", "1", "--backoff", "0.05", "--max-backoff", "0.2"]


def oomguard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oomguard", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def kills(rounds: int, per_round: int, seed: int) -> dict[str, Any]:
    total = campaign.Figures()
    started = time.monotonic()
    for i in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            f = campaign.run(Path(tmp), per_round, random.Random(seed + i), steps=60 + 30 * per_round)
        for name in ("kills", "starts", "duplicates", "survivors", "corruptions", "wrong_resumes", "torn_retried"):
            setattr(total, name, getattr(total, name) + getattr(f, name))
        total.problems += f.problems
    return {**total.__dict__, "rounds": rounds, "seconds": round(time.monotonic() - started, 1)}


def journals() -> dict[str, Any]:
    cases = failures = 0
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        done = Path(tmp) / "done"
        out = oomguard("run", "--run-dir", str(done), *RUN, "--", "true")
        assert out.returncode == 0, out.stderr
        for how in ("garbage", "half", "empty"):
            run_dir = Path(tmp) / how
            run_dir.mkdir()
            data = (done / "journal.sqlite").read_bytes()
            journal = run_dir / "journal.sqlite"
            journal.write_bytes({"garbage": os.urandom(len(data)), "half": data[:len(data) // 2], "empty": b""}[how])
            os.utime(journal, (time.time() - 60, time.time() - 60))
            before = hashlib.sha256(journal.read_bytes()).hexdigest()
            for cmd in (["status"], ["report"], ["stop"], ["logs"], ["run", *RUN, "--", "true"]):
                cases += 1
                res = oomguard(cmd[0], "--run-dir", str(run_dir), *cmd[1:])
                one_line = res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
                intact = hashlib.sha256(journal.read_bytes()).hexdigest() == before
                if res.returncode != 2 or not one_line or not intact:
                    failures += 1
                    problems.append(f"{how} {cmd[0]}: exit {res.returncode}, {res.stderr.strip()[:200]}")
    return {"cases": cases, "failures": failures, "problems": problems}


def disk() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(where)], capture_output=True)
        if mounted.returncode != 0:
            return {"skipped": "cannot mount a tmpfs"}
        try:
            out = oomguard("run", "--run-dir", str(where / "run"), *RUN, "--sample-interval", "0.2", "--",
                           sys.executable, campaign.WORKER, "fill_disk", "--path", str(where), "--seconds", "5")
            return {"exit": out.returncode, "integrity": campaign.integrity(where / "run"),
                    "degraded_said": out.stderr.count("degraded:"), "traceback": "Traceback" in out.stderr}
        finally:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description="the long fault campaign")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kills", type=int, default=15)
    p.add_argument("--seed", type=int, default=random.randrange(2**32))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = {"seed": args.seed, "kill": kills(args.rounds, args.kills, args.seed), "journal": journals(),
              "disk": disk()}
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
