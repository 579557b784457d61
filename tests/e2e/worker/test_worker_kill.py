"""kill -9 at random moments (also in the middle of checkpoint writes), resume, and end with
exactly the weights of an uninterrupted run; a changed micro-batch ends within float tolerance
and sees the same samples in every optimizer step."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from workerkit import (
    SMALL,
    Zygote,
    bitwise_equal,
    events,
    max_abs_diff,
    samples_per_step,
    wait_for,
    weights,
)

KILLS = int(os.environ.get("OOMGUARD_TEST_KILLS", "24"))
STEPS = max(100, 5 * KILLS)  # long enough that every kill lands before the run ends
BASE = [
    *SMALL,
    "--steps",
    str(STEPS),
    "--global-batch",
    "32",
    "--micro-batch",
    "8",
    "--checkpoint-every",
    "1",
]


def reference(zygote: Zygote, out: Path, extra: list[str]) -> tuple[Path, Path]:
    out.mkdir()
    argv = [*BASE, *extra, "--checkpoint-dir", str(out / "ckpt"), "--save-weights", str(out / "w.pt"),
            "--log-samples", str(out / "samples.jsonl")]  # fmt: skip
    assert zygote.run(argv, out / "log.txt") == 0, (out / "log.txt").read_text()
    return out / "w.pt", out / "samples.jsonl"


def writing(ckpt: Path, pid: int) -> bool:
    """Process ``pid`` is writing a checkpoint right now (its temp directory, ``.checkpoint-N.tmp-PID-THREAD``,
    exists; one a process killed earlier left behind is not this one's)."""
    try:
        return any(name.startswith(".checkpoint-") and f".tmp-{pid}-" in name for name in os.listdir(ckpt))
    except FileNotFoundError:
        return False


def progress(out: Path) -> int:
    return sum(e["type"] == "progress" for e in events(out / "events.jsonl"))


def campaign(zygote: Zygote, out: Path, argv: list[str], kills: int, seed: int) -> dict[str, int]:
    """Start, kill -9, resume, ... ``kills`` times; then let it finish. Returns what happened."""
    rnd = random.Random(seed)
    ckpt = out / "ckpt"
    env = {"OOMGUARD_EVENTS": str(out / "events.jsonl")}
    seen = {"killed": 0, "mid_write": 0, "finished_early": 0}
    while seen["killed"] < kills:
        steps = progress(out)
        pid = zygote.spawn(argv, out / "log.txt", env)
        # The kill lands in training, after the first step (its progress record): on a loaded machine the start
        # alone can outlast the random delay, and no kill would then come after a checkpoint or a resume.
        wait_for(lambda n=steps: progress(out) > n, timeout=60, interval=0.01)
        if seen["killed"] % 2:  # every other kill aims at a checkpoint write in progress
            wait_for(lambda p=pid: writing(ckpt, p), timeout=10)
        else:
            # A random moment counted in steps, then a few ms into the next: a wall-clock delay lets an idle
            # machine run so many steps that the run ends before the last kill, and a loaded one none.
            more = progress(out) + rnd.randint(0, 2)
            wait_for(lambda n=more: progress(out) >= n, timeout=60, interval=0.002)
            time.sleep(rnd.uniform(0.0, 0.01))
        os.kill(pid, signal.SIGKILL)
        mid_write = writing(ckpt, pid)
        status = zygote.wait(pid)
        if status == 0:
            seen["finished_early"] += 1
            break
        assert status == -signal.SIGKILL, (out / "log.txt").read_text()[-3000:]
        seen["killed"] += 1
        seen["mid_write"] += mid_write
    assert zygote.run(argv, out / "log.txt", env) == 0, (out / "log.txt").read_text()[-3000:]
    return seen


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill9_anywhere_then_resume_is_bitwise_identical(zygote: Zygote, tmp_path: Path, mode: str) -> None:
    extra = ["--dropout", "0.1"] + (["--async-save"] if mode == "async" else [])
    ref_w, ref_samples = reference(zygote, tmp_path / "ref", extra)
    out = tmp_path / "killed"
    out.mkdir()
    argv = [*BASE, *extra, "--checkpoint-dir", str(out / "ckpt"), "--save-weights", str(out / "w.pt"),
            "--log-samples", str(out / "samples.jsonl")]  # fmt: skip
    kills = KILLS if mode == "sync" else KILLS // 2
    seen = campaign(zygote, out, argv, kills, seed=1234 if mode == "sync" else 99)

    assert seen["killed"] == kills and seen["finished_early"] == 0, seen
    assert seen["mid_write"] >= 1, f"no kill landed inside a checkpoint write: {seen}"
    resumed = [e for e in events(out / "events.jsonl") if e["type"] == "batch" and e["reason"] == "resume"]
    assert len(resumed) >= kills // 2, "the restarts did not resume from checkpoints"
    assert bitwise_equal(weights(out / "w.pt"), weights(ref_w))
    assert samples_per_step(out / "samples.jsonl") == samples_per_step(ref_samples)
    leftovers = [p.name for p in (out / "ckpt").iterdir() if p.name.startswith(".")]
    assert leftovers == [], f"temp or trash directories left behind: {leftovers}"


def trained_at(path: Path, micro: int, timeout: float = 60.0) -> None:
    """Wait until the worker reports a step at ``micro`` (the kill must land after the resize took)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        lines = text[: text.rfind("\n") + 1].splitlines()  # the worker may be writing the last line now
        if any(e["type"] == "progress" and e["micro_batch"] == micro for e in map(json.loads, filter(None, lines))):
            return
        time.sleep(0.02)
    raise AssertionError(f"no step at micro-batch {micro} within {timeout:.0f} s")


def test_resume_at_another_micro_batch_is_within_tolerance(zygote: Zygote, tmp_path: Path) -> None:
    extra = ["--dropout", "0"]  # dropout masks follow the micro-batch split; the math must not
    ref_w, ref_samples = reference(zygote, tmp_path / "ref", extra)
    out = tmp_path / "changed"
    out.mkdir()
    argv = [*BASE, *extra, "--checkpoint-dir", str(out / "ckpt"), "--save-weights", str(out / "w.pt"),
            "--log-samples", str(out / "samples.jsonl")]  # fmt: skip
    rnd = random.Random(7)
    for micro in ("16", "4", "32", "2"):  # every restart at another size, as the supervisor would
        env = {"OOMGUARD_MICRO_BATCH": micro, "OOMGUARD_EVENTS": str(out / "events.jsonl")}
        pid = zygote.spawn(argv, out / "log.txt", env)
        trained_at(out / "events.jsonl", int(micro))  # under load a fixed sleep killed some before a step
        time.sleep(rnd.uniform(0.0, 0.1))
        os.kill(pid, signal.SIGKILL)
        assert zygote.wait(pid) == -signal.SIGKILL
    env = {"OOMGUARD_MICRO_BATCH": "1", "OOMGUARD_EVENTS": str(out / "events.jsonl")}
    assert zygote.run(argv, out / "log.txt", env) == 0, (out / "log.txt").read_text()[-3000:]

    sizes = {e["micro_batch"] for e in events(out / "events.jsonl") if e["type"] == "progress"}
    assert len(sizes) >= 3, f"the restarts did not train at several micro-batches: {sizes}"
    diff = max_abs_diff(weights(out / "w.pt"), weights(ref_w))
    assert diff < 1e-5, diff
    assert samples_per_step(out / "samples.jsonl") == samples_per_step(ref_samples)
