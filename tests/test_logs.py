"""`oomguard logs`: a real run's attempt logs, and `-f` following a live run across two attempts."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from support import ROOT, oomguard

from oomguard.supervisor.record.logs import CUT_MARKER, GAP, AttemptLog, follow, log_file

PY = sys.executable

# Attempt 1 prints, waits for the test's go-ahead, prints again and dies of a CUDA OOM; attempt 2
# (at half the micro-batch) finishes.
WORKER = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path

    attempt, go = os.environ["OOMGUARD_ATTEMPT"], Path(sys.argv[1])
    print(f"attempt {attempt} first line micro={os.environ['OOMGUARD_MICRO_BATCH']}", flush=True)
    if attempt == "1":
        deadline = time.monotonic() + 30
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        print("attempt 1 second line", flush=True)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.", flush=True)
        sys.exit(1)
    print("attempt 2 finished", flush=True)
''')


def start_run(tmp_path: Path, run_dir: Path) -> tuple[subprocess.Popen[str], Path]:
    worker, go = tmp_path / "worker.py", tmp_path / "go"
    worker.write_text(WORKER)
    proc = subprocess.Popen([PY, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--no-web",
                             "--backoff", "0.05", "--micro-batch", "8", "--global-batch", "16",
                             "--", PY, str(worker), str(go)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, go


def wait_for(predicate, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def log_has(run_dir: Path, attempt: int, text: str) -> bool:
    path = run_dir / "logs" / f"attempt-{attempt}.log"
    return path.exists() and text in path.read_text()


def test_follow_across_two_attempts_until_the_run_ends(tmp_path: Path, run_dir: Path) -> None:
    """The follower attaches while attempt 1 is running (it has printed attempt 1's first line, and
    attempt 1 waits for the test's go-ahead), then follows it and attempt 2 to the run's end."""
    proc, go = start_run(tmp_path, run_dir)
    follower = None
    lines: list[str] = []
    attached = threading.Event()

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.append(line)
            if "attempt 1 first line" in line:
                attached.set()

    try:
        wait_for(lambda: log_has(run_dir, 1, "attempt 1 first line"))
        follower = subprocess.Popen([PY, "-m", "oomguard", "logs", "--run-dir", str(run_dir), "-f"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert follower.stdout is not None
        reader = threading.Thread(target=read, args=(follower.stdout,), daemon=True)
        reader.start()
        assert attached.wait(60), lines  # following attempt 1 while it still runs
        assert follower.poll() is None and proc.poll() is None
        go.touch()
        assert follower.wait(timeout=60) == 0
        reader.join(30)
        err = follower.stderr.read() if follower.stderr else ""
        assert proc.wait(timeout=30) == 0
    finally:
        for p in (proc, follower):
            if p is not None and p.poll() is None:
                p.kill()
    out = "".join(lines)
    expected = ["attempt 1 first line micro=8", "attempt 1 second line", "CUDA out of memory",
                "==> attempt-2.log <==", "attempt 2 first line micro=4", "attempt 2 finished"]
    positions = [out.index(line) for line in expected]
    assert positions == sorted(positions), out
    assert "run succeeded" in err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("finished")
    run_dir = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OOMGUARD_CACHE_DIR", str(tmp / "cache"))  # nothing learned by earlier runs
        proc, go = start_run(tmp, run_dir)
    go.touch()
    assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    return run_dir


def test_prints_the_latest_or_the_chosen_attempt(finished_run: Path) -> None:
    latest = oomguard("logs", "--run-dir", str(finished_run))
    assert latest.returncode == 0 and latest.stdout == "attempt 2 first line micro=4\nattempt 2 finished\n"
    first = oomguard("logs", "--run-dir", str(finished_run), "--attempt", "1")
    assert first.returncode == 0 and first.stdout.startswith("attempt 1 first line micro=8\n")
    # -f on a finished run prints the latest log and returns at once.
    follow = oomguard("logs", "--run-dir", str(finished_run), "-f", timeout=10)
    assert follow.returncode == 0 and follow.stdout == latest.stdout


@pytest.mark.parametrize("args,needle", [
    (["--attempt", "3"], "--attempt: attempt 3 has no log"),
    (["--attempt", "0"], "--attempt: 0 is not an attempt number"),
    (["--attempt", "two"], "--attempt"),
])
def test_bad_attempt_is_one_line_and_exit_2(finished_run: Path, args: list[str], needle: str) -> None:
    out = oomguard("logs", "--run-dir", str(finished_run), *args)
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0


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
