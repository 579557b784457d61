"""The cross-run fit store: keys, merging, durability across a killed writer, concurrent writers."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.supervisor.decide.fitstore import FitRecord, FitStore, JobKey, default_cache_dir, merge_point
from oomguard.supervisor.decide.memmodel import Point

GIB = 1024**3
H100 = ("NVIDIA H100 80GB HBM3", 80 * GIB)
KEY = JobKey(("python", "train.py", "--batch_size={micro_batch}"), (H100,), 1)


def test_fingerprint_depends_on_command_gpu_and_world_size() -> None:
    same = JobKey(("python", "train.py", "--batch_size={micro_batch}"), (H100,), 1)
    assert same.fingerprint == KEY.fingerprint
    others = [
        JobKey(("python", "train.py"), (H100,), 1),
        JobKey(KEY.command, (("NVIDIA A100-SXM4-40GB", 40 * GIB),), 1),
        JobKey(KEY.command, (H100,), 2),
        JobKey(KEY.command, (), 1),
    ]
    assert len({k.fingerprint for k in others} | {KEY.fingerprint}) == 5
    assert "H100" in KEY.describe()


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert FitStore().path.parent == tmp_path / "c"
    monkeypatch.delenv("OOMGUARD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "oomguard"


def test_records_survive_a_new_store(tmp_path: Path) -> None:
    store = FitStore(tmp_path)
    assert store.load(KEY) is None
    store.record(KEY, Point(96, 80 * GIB, False))
    store.record(KEY, Point(48, 80 * GIB, False))
    store.record(KEY, Point(24, 52 * GIB, True))
    store.record(KEY, Point(32, 66 * GIB, True))
    again = FitStore(tmp_path).load(KEY)
    assert again is not None
    assert (again.micro_batch, again.failed_micro) == (32, 48)
    assert [p.micro_batch for p in again.points] == [24, 32, 48, 96]
    assert again.starting_micro(96, 96) == 32  # a new run starts where the last one ended
    store.forget(KEY)
    assert store.load(KEY) is None


def test_merge_keeps_failures_and_worst_peaks() -> None:
    base = FitRecord("fp", "job", None, None, (), 0.0)
    rec = merge_point(base, Point(32, 60, True), 1.0)
    rec = merge_point(rec, Point(32, 70, True), 2.0)
    assert rec.points == (Point(32, 70, True),) and rec.micro_batch == 32
    rec = merge_point(rec, Point(32, 50, False), 3.0)  # failed once: stays failed
    assert rec.points == (Point(32, 70, False),) and rec.micro_batch is None and rec.failed_micro == 32


@pytest.mark.parametrize(
    ("worked", "failed", "batch", "requested", "start"),
    [
        (32, 48, 96, 96, 32),
        (32, 48, 96, 16, None),  # the user asked for less: respect it
        (32, None, 96, 96, None),  # nothing ever failed: no reason to start lower
        (32, 48, 64, 64, 32),
        (24, 48, 40, 40, 20),  # a different per-process batch: the largest divisor below
        (None, 48, 96, 96, 32),  # only a failure known: the largest divisor below it
        (None, 1, 96, 96, None),  # nothing can fit: leave it to the policy
    ],
)
def test_starting_micro(
    worked: int | None, failed: int | None, batch: int, requested: int, start: int | None
) -> None:
    record = FitRecord("fp", "job", worked, failed, (), 0.0)
    assert record.starting_micro(batch, requested) == start


WRITER = """
import os, sys
from oomguard.supervisor.decide.fitstore import FitStore, JobKey
from oomguard.supervisor.decide.memmodel import Point
gpu = ("NVIDIA H100 80GB HBM3", 80 * 1024**3)
key = JobKey(("python", "train.py", "--batch_size={micro_batch}"), (gpu,), 1)
FitStore(sys.argv[1]).record(key, Point(24, 123, True))
print("committed", flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_commit_survives_kill_9(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL and "committed" in proc.stdout
    record = FitStore(tmp_path).load(KEY)
    assert record is not None and record.points == (Point(24, 123, True),)


def _record_many(directory: str, start: int) -> None:
    store = FitStore(directory)
    for micro in range(start, start + 20):
        store.record(KEY, Point(micro, micro * 10, True))


def test_concurrent_supervisors_lose_nothing(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_record_many, args=(str(tmp_path), 1 + 20 * i)) for i in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert all(w.exitcode == 0 for w in workers)
    record = FitStore(tmp_path).load(KEY)
    assert record is not None and len(record.points) == 60 and record.micro_batch == 60


def _rerun_keys(tmp_path: Path, template: str) -> tuple[JobKey, JobKey]:
    """The keys of two runs of one command whose run directory is ``runs/monday``, then ``runs/tuesday``."""
    def key(day: str) -> JobKey:
        token = template.format(out=f"runs/{day}", abs=tmp_path / "runs" / day)
        return JobKey.for_run(["python", "train.py", token], tmp_path, [tmp_path / "runs" / day], (), 1, GIB)
    return key("monday"), key("tuesday")


@pytest.mark.parametrize(
    ("template", "written"),
    [
        ("{out}", "{output}"),
        ("{abs}/log.txt", "{output}"),
        ("--log={out}/log.txt", "--log={output}"),
        ("--log={out}/bs{{micro_batch}}.txt", "--log={output}"),  # a placeholder in the path
        ("{out}/bs{{micro_batch}}.txt", "{output}"),
        ("hydra.run.dir={out}", "hydra.run.dir={output}"),  # Hydra's override
        ("output_dir={abs}", "output_dir={output}"),
        ("+trainer.default_root_dir={out}/lightning", "+trainer.default_root_dir={output}"),
        ("--cfg-options=work_dir={out}", "--cfg-options=work_dir={output}"),  # mmdetection
    ],
)
def test_a_new_output_directory_is_the_same_job_however_the_command_names_it(
        tmp_path: Path, template: str, written: str) -> None:
    monday, tuesday = _rerun_keys(tmp_path, template)
    assert monday.command == ("python", "train.py", written)
    assert monday.fingerprint == tuesday.fingerprint


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("lr=3e-4", "lr=1e-3"),
        ("n_layer=12", "n_layer=24"),
        ("model=gpt2-medium", "model=gpt2-large"),
        ("--n-embd=768", "--n-embd=1024"),
        ("data=runs/mondays", "data=runs/mondayz"),  # share a prefix with runs/monday, lie outside it
        ("runs/monday2/x", "runs/monday3/x"),
        ("runs/monday-old", "runs/monday-new"),
    ],
)
def test_a_changed_hyperparameter_is_a_new_job_whatever_the_output_directory(
        tmp_path: Path, one: str, other: str) -> None:
    def key(token: str) -> JobKey:
        return JobKey.for_run(["python", "train.py", token, "hydra.run.dir=runs/monday"], tmp_path,
                              [tmp_path / "runs" / "monday"], (), 1, GIB)
    first, second = key(one), key(other)
    assert first.command[2:] == (one, "hydra.run.dir={output}")  # kept as written
    assert first.fingerprint != second.fingerprint


def test_a_config_files_content_is_still_the_job_next_to_an_output_override(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text("n_layer: 12\n")
    command = ["python", "train.py", "--config=model.yaml", "output_dir=runs/monday", "--bs", "{micro_batch}"]
    before = JobKey.for_run(command, tmp_path, [tmp_path / "runs" / "monday"], (), 1, GIB)
    assert before.command[2:] == ("--config=model.yaml", "output_dir={output}", "--bs", "{micro_batch}")
    (tmp_path / "model.yaml").write_text("n_layer: 24\n")
    after = JobKey.for_run(command, tmp_path, [tmp_path / "runs" / "monday"], (), 1, GIB)
    assert before.fingerprint != after.fingerprint
