"""`oomguard report` on a real run through every failure kind (the tests on a scripted journal are in
tests/unit/supervisor/record/test_report.py)."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import oomguard

from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.report import build_report

KINDS = ["cuda_oom", "crash", "host_oom", "killed", "memory_limit", "hang"]


# Attempt n resumes from the newest checkpoint, takes two checkpointed steps, then n steps that no
# checkpoint keeps, then fails as KINDS[n - 1] (attempt 7 finishes). So attempt n redoes n steps.
WORKER = textwrap.dedent('''
    import json, os, signal, sys, time
    from pathlib import Path

    attempt = int(os.environ["OOMGUARD_ATTEMPT"])
    root = Path(sys.argv[1])
    step = int(os.environ["OOMGUARD_CHECKPOINT_STEP"] or 0)

    def report(**fields):
        with open(os.environ["OOMGUARD_EVENTS"], "a") as fh:
            fh.write(json.dumps({"type": "progress", "t": time.time(), **fields}) + "\\n")

    for checkpointed in [True] * 2 + [False] * attempt:
        step += 1
        report(step=step, samples=step * 64, loss=1.0 / step)
        if checkpointed:
            tmp = root / f"tmp-{step}"
            tmp.mkdir(parents=True)
            (tmp / "state").write_text(str(step))
            os.rename(tmp, root / f"checkpoint-{step}")
        time.sleep(0.05)
    print(f"attempt {attempt} at step {step}", flush=True)
    if attempt == 1:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", flush=True)
        sys.exit(1)
    if attempt == 2:
        print("ValueError: bad data in shard 7", flush=True)
        sys.exit(3)
    if attempt == 3:
        print("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes",
              flush=True)
        sys.exit(1)
    if attempt == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 5:
        held = [bytearray(16 * 2**20) for _ in range(20)]  # 320 MiB, really touched
        while True:
            print("holding", len(held), flush=True)
            time.sleep(0.2)
    if attempt == 6:
        while True:
            time.sleep(1)
''')


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A real run whose attempts end as each failure kind in turn, then succeed."""
    tmp = tmp_path_factory.mktemp("every-kind")
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    run_dir, ckpts = tmp / "run", tmp / "ckpt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OOMGUARD_CACHE_DIR", str(tmp / "cache"))  # nothing learned by earlier runs
        out = oomguard("run", "--run-dir", str(run_dir), "--no-web", "--backoff", "0.05", "--max-backoff",
                       "0.2", "--micro-batch", "16", "--global-batch", "64", "--memory-limit", "200M",
                       "--hang-timeout", "1.5", "--sample-interval", "0.2",
                       "--checkpoint", f"{ckpts}/checkpoint-*",
                       "--", sys.executable, str(worker), str(ckpts), timeout=90)
    assert out.returncode == 0, out.stderr
    journal = Journal(run_dir, readonly=True)
    try:
        yield run_dir, build_report(journal)
    finally:
        journal.close()


def test_every_failure_kind_with_its_decision(every_kind: tuple[Path, dict[str, Any]]) -> None:
    _, report = every_kind
    assert report["state"] == "succeeded" and report["finished"] and report["attempts"] == 7
    failures = report["failures"]
    assert [f["kind"] for f in failures] == KINDS
    by_kind = {f["kind"]: f for f in failures}
    assert "CUDA out of memory" in by_kind["cuda_oom"]["evidence"]
    assert "DefaultCPUAllocator" in by_kind["host_oom"]["evidence"]
    assert "--memory-limit" in by_kind["memory_limit"]["evidence"]
    # Steps are known from the worker's progress records, so the hang is "no progress", not the
    # "no output or progress" of a worker whose steps are unknown (a substring of both would pass either).
    assert by_kind["hang"]["evidence"].startswith("no progress for "), by_kind["hang"]["evidence"]
    assert by_kind["killed"]["signal"] == 9 and by_kind["crash"]["exit_code"] == 3
    # Memory failures halve the micro-batch; the others restart at the same one.
    assert [(f["micro_batch"], f["decision"]["micro_batch"]) for f in failures] == [
        (16, 8), (8, 8), (8, 4), (4, 4), (4, 2), (2, 2)]
    assert all(f["decision"]["action"] == "restart" and f["decision"]["reason"] for f in failures)


def test_steps_and_time_lost(every_kind: tuple[Path, dict[str, Any]]) -> None:
    _, report = every_kind
    failures = report["failures"]
    assert [f["steps_lost"] for f in failures] == [1, 2, 3, 4, 5, 6]
    assert report["steps_lost"] == 21 and report["steps_lost_exact"]
    assert [f["resumed_from"]["step"] for f in failures] == [2, 4, 6, 8, 10, 12]
    assert [f["last_step"] for f in failures] == [3, 6, 9, 12, 15, 18]
    assert all(f["lost_s"] > 0 for f in failures)
    assert by_kind_lost(failures, "hang") >= 1.5  # the hang went unnoticed for --hang-timeout
    assert 0 < report["lost_s"] < report["total_s"]
    assert report["lost_s"] == pytest.approx(sum(f["lost_s"] + f["gap_s"] for f in failures))


def by_kind_lost(failures: list[dict[str, Any]], kind: str) -> float:
    return float(next(f["lost_s"] for f in failures if f["kind"] == kind))


def test_batch_history_and_checkpoints(every_kind: tuple[Path, dict[str, Any]]) -> None:
    _, report = every_kind
    history = report["batch_history"]
    assert [(h["attempt"], h["micro_batch"], h["grad_accum"]) for h in history] == [
        (1, 16, 4), (2, 8, 8), (4, 4, 16), (6, 2, 32)]
    assert {h["global_batch"] for h in history} == {64}
    assert history[0]["reason"] == "initial" and "cuda_oom" in history[1]["reason"]
    checkpoints = report["checkpoints"]
    # The last attempt's two checkpoints may not have settled before it exited (loop's choice).
    assert checkpoints["count"] in (12, 14) and checkpoints["bad"] == []
    assert checkpoints["newest"]["step"] == checkpoints["count"]
    assert report["progress"]["step"] == 21


def test_cli_text_and_json(every_kind: tuple[Path, dict[str, Any]]) -> None:
    run_dir, report = every_kind
    out = oomguard("report", "--run-dir", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["failures"] == json.loads(json.dumps(report["failures"]))
    text = oomguard("report", "--run-dir", str(run_dir))
    assert text.returncode == 0, text.stderr
    for needle in ["final state: succeeded", "steps lost (redone): 21", *KINDS,
                   "micro 2 × accum 32 × world 1 = 64",
                   f"checkpoints: {report['checkpoints']['count']} seen"]:
        assert needle in text.stdout, needle
