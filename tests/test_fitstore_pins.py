"""The fit store's edges the mutation run found unpinned (docs/mutation.md): where the store lives, the
key's description a re-run's reason quotes, which tokens of a command are the places a run writes,
the file digest at its size cut-off, and what a stored record keeps."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from oomguard.supervisor.record.fitstore import _HASHED_MAX, OUTPUT, FitStore, JobKey, default_cache_dir
from oomguard.supervisor.sizing.memmodel import Point
from oomguard.supervisor.sizing.tuning import FitRecord, merge_point

GIB = 2**30
H100 = ("NVIDIA H100 80GB HBM3", 80 * GIB)


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
