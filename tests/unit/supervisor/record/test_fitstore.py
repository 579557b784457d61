"""The cross-run fit store: keys, merging, durability across a killed writer, concurrent writers."""

from __future__ import annotations

import hashlib
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from support import DATA, ROOT

from oomguard.supervisor.record.fitstore import _HASHED_MAX, OUTPUT, FitStore, JobKey, default_cache_dir
from oomguard.supervisor.sizing.memmodel import FitRecord, ModelPrint, Point, SizeTuner, merge_point

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
from oomguard.supervisor.record.fitstore import FitStore, JobKey
from oomguard.supervisor.sizing.memmodel import Point
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
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL and "committed" in proc.stdout
    record = FitStore(tmp_path).load(KEY)
    assert record is not None and record.points == (Point(24, 123, True),)


MANY = """
import sys
from oomguard.supervisor.record.fitstore import FitStore, JobKey
from oomguard.supervisor.sizing.memmodel import Point
gpu = ("NVIDIA H100 80GB HBM3", 80 * 1024**3)
key = JobKey(("python", "train.py", "--batch_size={micro_batch}"), (gpu,), 1)
store, start = FitStore(sys.argv[1]), int(sys.argv[2])
for micro in range(start, start + 20):
    store.record(key, Point(micro, micro * 10, True))
"""


def test_concurrent_supervisors_lose_nothing(tmp_path: Path) -> None:
    """Three supervisors' processes record into one store at once: every point is kept. Real
    interpreters, not forks of this one: a fork of a test process whose other threads (an earlier
    test's) held a lock at that instant could hang, which says nothing about the store."""
    writers = [subprocess.Popen([sys.executable, "-c", MANY, str(tmp_path), str(1 + 20 * i)],
                                cwd=ROOT, stderr=subprocess.PIPE, text=True)
               for i in range(3)]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0, 0], errors
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


# --- the model a record was measured with -------------------------------------------------------

SMALL, LARGE = ModelPrint("a1" * 8, 1_000_000, 10), ModelPrint("b2" * 8, 3_000_000, 14)
BEFORE_MODELS = DATA / "fits-before-models.sqlite3"  # made by the code before this change


def test_a_store_made_before_models_were_kept_opens_and_keeps_working(tmp_path: Path) -> None:
    # The database the previous fitstore.py wrote (KEY: 24 and 32 fit, 48 and 96 failed); opened, it gains
    # the models table and keeps its record, which knows no model: today's behaviour.
    shutil.copy(BEFORE_MODELS, tmp_path / "fits.sqlite3")
    store = FitStore(tmp_path)
    old = store.load(KEY)
    assert old is not None and (old.micro_batch, old.failed_micro, old.models) == (32, 48, ())
    assert old.measured(SMALL) is None and old.starting_micro(96, 96) == 32
    mended = store.record(KEY, Point(24, 50 * GIB, True), [SMALL])  # the first run with the probe: merged
    assert (mended.micro_batch, mended.failed_micro, mended.models) == (32, 48, (SMALL,))
    assert store.load(KEY) == mended
    # An older oomguard sharing the cache directory still reads and writes its table (its statements, verbatim).
    with sqlite3.connect(tmp_path / "fits.sqlite3") as db:
        row = db.execute("SELECT fingerprint, description, micro_batch, failed_micro, points, updated_wall"
                         " FROM fits WHERE fingerprint = ?", (KEY.fingerprint,)).fetchone()
        db.execute("INSERT OR REPLACE INTO fits VALUES (?, ?, ?, ?, ?, ?)", (*row[:4], row[4], 5.0))
    assert store.load(KEY) == replace(mended, updated_wall=5.0)


def test_a_record_keeps_its_models_and_another_models_replaces_it(tmp_path: Path) -> None:
    store = FitStore(tmp_path)
    store.record(KEY, Point(32, 70, False), [SMALL])
    store.record(KEY, Point(16, 40, True), [SMALL])
    record = store.load(KEY)
    assert record is not None and record.models == (SMALL,) and record.measured(SMALL) is True
    assert record.measured(LARGE) is False
    unseen = store.record(KEY, Point(8, 20, True))  # an attempt before the probe said: merged as before
    assert unseen.points == (Point(8, 20, True), Point(16, 40, True), Point(32, 70, False))
    assert unseen.models == (SMALL,)
    other = store.record(KEY, Point(8, 30, True), [LARGE])  # none of the record's models: not merged into
    assert (other.points, other.models, other.failed_micro) == ((Point(8, 30, True),), (LARGE,), None)
    both = store.record(KEY, Point(4, 15, True), [SMALL, LARGE])  # ranks of two stages: one of them known
    assert both.models == (SMALL, LARGE) and [p.micro_batch for p in both.points] == [4, 8]
    rewritten = store.rewrite(KEY, [Point(16, None, False)], [SMALL])
    assert store.load(KEY) == rewritten
    assert (rewritten.points, rewritten.models, rewritten.failed_micro) == ((Point(16, None, False),), (SMALL,), 16)
    store.forget(KEY)
    assert store.load(KEY) is None
    assert store.record(KEY, Point(2, 1, True)).models == ()  # forgotten with its models


def test_a_model_record_is_read_only_when_it_names_a_digest_and_a_count() -> None:
    assert ModelPrint.from_record({"digest": "ab", "params": 5, "tensors": 2}) == ModelPrint("ab", 5, 2)
    assert ModelPrint.from_record({"digest": "ab", "params": 5}) == ModelPrint("ab", 5, 0)
    for bad in ({"params": 5}, {"digest": "", "params": 5}, {"digest": "ab", "params": "5"},
                {"digest": "ab", "params": True}, {"digest": 7, "params": 5}):
        assert ModelPrint.from_record(bad) is None


def _tuner(store: FitStore, requested: int = 16) -> tuple[SizeTuner, int | None]:
    tuner = SizeTuner(per_process_batch=16, min_micro=1, margin=0.1, store=store, key=KEY)
    return tuner, tuner.starting_micro(requested)


def test_a_rerun_that_started_from_another_models_record_restarts_at_the_size_asked_for(tmp_path: Path) -> None:
    store = FitStore(tmp_path)
    store.record(KEY, Point(16, None, False), [SMALL])
    store.record(KEY, Point(8, 100, True), [SMALL])
    tuner, start = _tuner(store)
    assert start == 8 and tuner.stored_failures == [Point(16, None, False)]
    change = tuner.model_seen(LARGE, 8)
    assert change is not None and (change.then, change.now, change.restart_at) == (SMALL, LARGE, 16)
    assert "3,000,000 parameters" in change.text and "1,000,000" in change.text and "asked for, 16" in change.text
    assert tuner.stored_failures == []  # the other model's OOM at 16 no longer bars 16
    record = store.load(KEY)
    assert record is not None and (record.points, record.models) == ((), (LARGE,))  # it steers nothing now
    assert tuner.model_seen(LARGE, 8) is None  # said once per run (each rank reports its own)
    tuner.record(8, 90, memory_failed=False)
    tuner.record(16, None, memory_failed=True)
    record = store.load(KEY)
    assert record is not None and (record.micro_batch, record.failed_micro, record.models) == (8, 16, (LARGE,))
    assert _tuner(store)[0].model_seen(LARGE, 8) is None  # the next run of the new model: measured, no change


def test_the_same_model_or_a_record_without_one_keeps_steering(tmp_path: Path) -> None:
    store = FitStore(tmp_path)
    store.record(KEY, Point(16, None, False), [SMALL])
    store.record(KEY, Point(8, 100, True), [SMALL])
    tuner, start = _tuner(store)
    assert start == 8 and tuner.model_seen(SMALL, 8) is None
    assert tuner.stored_failures == [Point(16, None, False)]
    unknown = FitStore(tmp_path / "unknown")  # an older store's record, or one made with --no-probe
    unknown.record(KEY, Point(16, None, False))
    unknown.record(KEY, Point(8, 100, True))
    tuner, start = _tuner(unknown)
    assert start == 8 and tuner.model_seen(LARGE, 8) is None
    tuner.record(8, 100, memory_failed=False)
    record = unknown.load(KEY)
    assert record is not None and record.models == (LARGE,) and record.failed_micro == 16  # now it knows


def test_another_model_found_after_this_run_measured_is_not_restarted(tmp_path: Path) -> None:
    store = FitStore(tmp_path)
    store.record(KEY, Point(16, None, False), [SMALL])
    store.record(KEY, Point(8, 100, True), [SMALL])
    tuner, start = _tuner(store)
    tuner.record(8, None, memory_failed=True)  # the record's 8 failed before any step: the model is larger
    change = tuner.model_seen(LARGE, 4)
    assert change is not None and change.restart_at is None and "replace the record" in change.text
    record = store.load(KEY)  # this run's own failure at 8 is the record now, with its model
    assert record is not None and (record.points, record.models) == ((Point(8, None, False),), (LARGE,))
    asked_less, start = _tuner(FitStore(tmp_path / "asked"), requested=4)
    assert start is None and asked_less.model_seen(LARGE, 4) is None  # no record: nothing to compare with
    fitted = FitStore(tmp_path / "fitted")
    fitted.record(KEY, Point(16, 200, True), [LARGE])
    not_lowered, start = _tuner(fitted)  # nothing failed: started at the size asked for
    assert start is None
    change = not_lowered.model_seen(SMALL, 16)
    assert change is not None and change.restart_at is None


def test_a_token_too_long_for_a_file_name_is_no_job_file_and_no_traceback(tmp_path: Path) -> None:
    """``name=<300 characters>.yaml`` (a prompt, a long override) cannot name a file: the kernel's
    ENAMETOOLONG is no reason to end the run before it starts."""
    (tmp_path / "train.py").write_text("print(1)\n")
    long = "x" * 300 + ".yaml"
    key = JobKey.for_run(["python", "train.py", f"name={long}", long], tmp_path, [], (), 1, GIB)
    same = JobKey.for_run(["python", "train.py", f"name={long}", long], tmp_path, [], (), 1, GIB)
    assert key.fingerprint == same.fingerprint and len(key.files) == 1  # train.py alone


# --- merged from tests/test_fitstore_pins.py ----------------------------------------------------------------
# The fit store's edges the mutation run found unpinned (docs/mutation.md): where the store lives, the
# key's description a re-run's reason quotes, which tokens of a command are the places a run writes,
# the file digest at its size cut-off, and what a stored record keeps.




def test_without_any_variable_the_store_is_under_the_home_cache(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.delenv("OOMGUARD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "oomguard"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # set but empty: as if unset
    assert default_cache_dir() == tmp_path / ".cache" / "oomguard"


def test_a_store_given_a_directory_writes_its_database_there(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(tmp_path / "elsewhere"))
    store = FitStore(tmp_path / "mine")
    store.record(JobKey(("python", "train.py"), (), 1, GIB), Point(8, None, True))
    assert (tmp_path / "mine" / "fits.sqlite3").is_file()  # the documented file name
    assert not (tmp_path / "elsewhere").exists()


def test_a_record_says_when_it_was_last_updated(tmp_path: Path) -> None:
    store, key = FitStore(tmp_path), JobKey(("python", "train.py"), (), 1, GIB)
    before = time.time()
    store.record(key, Point(8, 100, True))
    loaded = store.load(key)
    assert loaded is not None and before <= loaded.updated_wall <= time.time()
    assert merge_point(loaded, Point(4, 50, True), 1234.5).updated_wall == 1234.5


def test_a_size_that_fit_twice_without_a_peak_reading_stays_a_fit() -> None:
    # Without per-process GPU figures a success carries no peak; merging two of them must not fail.
    record = merge_point(FitRecord("fp", "job", None, None, (), 0.0), Point(8, None, True), 1.0)
    record = merge_point(record, Point(8, None, True), 2.0)
    assert record.points == (Point(8, None, True),) and record.micro_batch == 8


def test_a_rerun_starts_right_below_a_failure_when_that_size_divides_the_batch() -> None:
    # 5 failed and nothing is known to work: 4 is the largest size below 5 that divides 20.
    assert FitRecord("fp", "job", None, 5, (), 0.0).starting_micro(20, 20) == 4


def test_the_description_a_reruns_reason_quotes() -> None:
    gpu = JobKey(("python", "train.py", "--bs", "{micro_batch}"),
                 (H100, ("NVIDIA A100-SXM4-40GB", 40 * GIB)), 2)
    assert gpu.describe() == ("python train.py --bs {micro_batch} | NVIDIA H100 80GB HBM3 80.0 GiB, "
                              "NVIDIA A100-SXM4-40GB 40.0 GiB | world 2")
    cpu = JobKey(("python", "train.py"), (), 1, 8 * GIB)
    assert cpu.describe() == "python train.py | no GPU | limit 8.0 GiB | world 1"
    assert JobKey(("python", "train.py"), (), 1).describe() == "python train.py | no GPU | world 1"
    long = JobKey(("python", "train.py", "--name", "x" * 300), (), 1)
    assert long.describe() == f"python train.py --name {'x' * 300}"[:200] + " | no GPU | world 1"


def test_the_working_directory_or_a_parent_given_as_a_write_place_swallows_nothing(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('model')\n")
    key = JobKey.for_run(["python", "train.py", "--data", "data"], tmp_path, [tmp_path, tmp_path.parent], (), 1, GIB)
    assert key.command == ("python", "train.py", "--data", "data")
    assert len(key.files) == 1 and key.files[0].startswith("train.py:")


def test_a_flag_whose_value_is_key_equals_path_has_its_path_taken_out(tmp_path: Path) -> None:
    # mmdetection's ``--cfg-options=work_dir=runs/monday``: the path is after the last "=".
    def key(out: str) -> JobKey:
        return JobKey.for_run(["python", "train.py", f"--cfg-options=work_dir={tmp_path / out}"], tmp_path,
                              [tmp_path / out], (), 1, GIB)
    assert key("monday").command[2] == f"--cfg-options=work_dir={OUTPUT}"
    assert key("monday").fingerprint == key("tuesday").fingerprint


def test_the_world_size_is_part_of_the_key(tmp_path: Path) -> None:
    one = JobKey.for_run(["python", "train.py"], tmp_path, [], (H100,), 1, None)
    two = JobKey.for_run(["python", "train.py"], tmp_path, [], (H100,), 2, None)
    assert two.world_size == 2 and one.fingerprint != two.fingerprint


def test_a_file_up_to_the_cut_off_is_fingerprinted_by_content(tmp_path: Path) -> None:
    # Two configs of exactly the cut-off size that differ in one byte are two jobs; past it, name and size only.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for directory, last in (("a", b"1"), ("b", b"2")):
        (tmp_path / directory / "big.json").write_bytes(b" " * (_HASHED_MAX - 1) + last)
    keys = [JobKey.for_run(["python", "train.py", f"{d}/big.json"], tmp_path, [], (), 1, GIB) for d in "ab"]
    content = (tmp_path / "a" / "big.json").read_bytes()
    assert keys[0].files == (f"big.json:{hashlib.sha256(content).hexdigest()[:16]}",)  # as earlier versions stored
    assert keys[0].fingerprint != keys[1].fingerprint
    (tmp_path / "a" / "big.json").write_bytes(content + b" ")
    past = JobKey.for_run(["python", "train.py", "a/big.json"], tmp_path, [], (), 1, GIB)
    assert past.files == (f"big.json:{_HASHED_MAX + 1}",)


def test_keys_that_did_not_change_keep_the_fingerprint_earlier_versions_stored(tmp_path: Path) -> None:
    # Figures computed by the version before ``key=path`` and placeholder paths were output: its stores are found.
    (tmp_path / "train.py").write_text("print('model')\n")
    command = ["python", "train.py", "--batch-size", "{micro_batch}", "lr=3e-4", "--output", "out",
               "--log=out/log.txt", "data=corpus/train", "--cfg-options=work_dir=out"]
    key = JobKey.for_run(command, tmp_path, [tmp_path / "out"], (H100,), 1, None)
    assert key.files == ("train.py:053d6b5bb2977da4",)
    assert key.fingerprint == "b44a2846b0aaf828df7bd4dcb22c0d15"
    assert JobKey.for_run(command, tmp_path, [tmp_path / "out"], (), 1, 8 * GIB).fingerprint == (
        "ae54343bfb5b62c76b4eef6f9e5b8ce1")
    legacy = JobKey(("python", "train.py", "--batch_size={micro_batch}"), (H100,), 1)
    assert legacy.fingerprint == "cb587c9a73c607f144d313d31c663145"


@pytest.mark.parametrize(
    ("token", "written"),
    [
        ("runs/x/a=b", OUTPUT),  # the whole token is a path in the place: not "runs/x/a={output}"
        ("--out=runs/x/a=b", f"--out={OUTPUT}"),  # the widest value after an "=" that is in the place
        ("k=v=runs/x", f"k=v={OUTPUT}"),
        ("runs/x{micro_batch}", "runs/x{micro_batch}"),  # shares the place's name, lies beside it
        ("{micro_batch}", "{micro_batch}"),
        ("--runs/x", "--runs/x"),  # a flag is no path
        ("-=runs/x", f"-={OUTPUT}"),
        ("=runs/x", f"={OUTPUT}"),
        ("runs=", "runs="),
        ("x=", "x="),
    ],
)
def test_which_part_of_a_token_is_the_output(tmp_path: Path, token: str, written: str) -> None:
    key = JobKey.for_run(["python", token], tmp_path, [tmp_path / "runs" / "x"], (), 1, GIB)
    assert key.command == ("python", written)


def test_a_bare_token_a_flags_value_or_an_overrides_value_names_a_file_to_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text("n_layer: 12\n")
    (tmp_path / "v=model.yaml").write_text("n_layer: 12\n")
    (tmp_path / "notes.txt").write_text("n_layer: 12\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.yaml").write_text("n_layer: 12\n")

    def files(*tokens: str) -> tuple[str, ...]:
        return JobKey.for_run(["python", *tokens], tmp_path, [tmp_path / "out"], (), 1, GIB).files
    assert len(files("model.yaml")) == 1 and files("model.yaml")[0].startswith("model.yaml:")
    assert files("--cfg=model.yaml") == files("--opt=k=model.yaml") == files("model.yaml")
    assert files("cfg=model.yaml") == files("model=k=model.yaml") == files("model.yaml")  # Hydra's, YOLO's
    assert files("v=model.yaml")[0].startswith("v=model.yaml:")  # a bare token that is a file is read whole
    assert files("--cfg", "{micro_batch}") == files("cfg=missing.yaml") == files("cfg=notes.txt") == ()
    assert files("out/model.yaml") == files("cfg=out/model.yaml") == ()  # in a place the run writes: output


def test_a_value_that_starts_with_a_dash_is_a_flag_even_where_a_file_of_its_name_exists(tmp_path: Path) -> None:
    (tmp_path / "--cfg.yaml").write_text("n_layer: 12\n")
    (tmp_path / "-o").mkdir()
    key = JobKey.for_run(["python", "--cfg.yaml", "k=-o/x", "-o/x", "--out=-o"], tmp_path, [tmp_path / "-o"],
                         (), 1, GIB)
    assert key.command == ("python", "--cfg.yaml", "k=-o/x", "-o/x", "--out=-o") and key.files == ()
