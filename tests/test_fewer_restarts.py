"""Fewer restarts (issue 29): scripted histories through the pure decide/ modules.

A job the fit store measured starts at the largest size known to fit (with the allocator setting it
fitted with); its key ignores where a run writes but not the script, the device or the limit; after an
OOM no size the evidence proves cannot fit is tried.
"""

from __future__ import annotations

from pathlib import Path

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide import replan
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.observe.allocator import AllocatorOom
from oomguard.supervisor.observe.checkpoints import CheckpointIndex
from oomguard.supervisor.record.fitstore import OUTPUT, FitStore, JobKey
from oomguard.supervisor.sizing.memmodel import OomFigures, Point, shrink_after_oom, unfit
from oomguard.supervisor.sizing.tuning import SizeTuner, figures_at_oom

MB = 2**20


def key_for(tmp_path: Path, out: str, limit: int | None = 8 * 2**30, gpus: tuple[tuple[str, int], ...] = ()
            ) -> JobKey:
    command = ["python", "train.py", "--batch-size", "{micro_batch}", "--output", str(tmp_path / out),
               f"--log={tmp_path / 'runs' / out / 'log.txt'}"]
    writes = [*CheckpointIndex([f"{tmp_path / out}/checkpoint-*"], tmp_path).directories(), tmp_path / "runs" / out]
    return JobKey.for_run(command, tmp_path, writes, gpus, 1, limit)


def test_the_places_a_run_writes_are_not_the_job(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('model v1')\n")
    first, second = key_for(tmp_path, "out-monday"), key_for(tmp_path, "out-tuesday")
    assert first.command.count(OUTPUT) == 1 and "--log={output}" in first.command
    assert first.fingerprint == second.fingerprint
    assert first.files and first.files[0].startswith("train.py:")


def test_a_relative_output_directory_is_output_before_and_after_it_exists(tmp_path: Path) -> None:
    command = ["python", "train.py", "--output", "out", "--bs", "{micro_batch}"]
    writes = CheckpointIndex(["out/checkpoint-*"], tmp_path).directories()
    before = JobKey.for_run(command, tmp_path, writes, (), 1, None)
    (tmp_path / "out").mkdir()
    after = JobKey.for_run(command, tmp_path, writes, (), 1, None)
    assert before.command[3] == OUTPUT and before.fingerprint == after.fingerprint


def test_the_script_the_device_and_the_limit_are(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('model v1')\n")
    base = key_for(tmp_path, "out")
    assert key_for(tmp_path, "out", limit=4 * 2**30).fingerprint != base.fingerprint
    h100 = (("NVIDIA H100 80GB HBM3", 80 * 2**30),)
    on_gpu = key_for(tmp_path, "out", gpus=h100)
    assert on_gpu.fingerprint != base.fingerprint and on_gpu.limit is None  # the GPU's memory is the limit
    (tmp_path / "train.py").write_text("print('model v2: twice the layers')\n")
    assert key_for(tmp_path, "out").fingerprint != base.fingerprint


def test_a_key_made_the_old_way_keeps_its_fingerprint() -> None:
    old = JobKey(("python", "train.py"), (), 1)
    assert old.fingerprint == JobKey(("python", "train.py"), (), 1, None, ()).fingerprint


def test_checkpoint_directories_never_swallow_the_working_directory(tmp_path: Path) -> None:
    index = CheckpointIndex(["ckpt/checkpoint-*", "*.pt", "out/last.pt", "/abs/run-*/model.pt"], tmp_path)
    assert index.directories() == [tmp_path / "ckpt", tmp_path / "out", Path("/abs")]


def test_a_measured_rerun_starts_at_the_largest_fitted_size(tmp_path: Path) -> None:
    store, key = FitStore(tmp_path / "store"), JobKey(("python", "train.py"), (), 1, 2**30)
    first = SizeTuner(64, 1, 0.1, store=store, key=key)
    for micro in (64, 32, 16):
        first.record(micro, None, memory_failed=True)
    first.record(8, None, memory_failed=False)  # no peak reading (no per-process GPU figures): still fits
    again = SizeTuner(64, 1, 0.1, store=store, key=key)
    assert again.starting_micro(64) == 8
    assert {p.micro_batch for p in again.stored_failures} == {16, 32, 64}


def test_on_a_gpu_the_start_keeps_the_allocator_setting_it_fitted_with() -> None:
    plan = Plan(BatchPlan(64, 64))
    on_gpu = replan.start_at_fitted(plan, 8, "job", gpu=True)
    assert on_gpu is not None and on_gpu.plan.batch.micro_batch == 8 and on_gpu.plan.expandable_segments
    assert "expandable_segments:True" in on_gpu.reason
    on_cpu = replan.start_at_fitted(plan, 8, "job")
    assert on_cpu is not None and not on_cpu.plan.expandable_segments


def test_an_earlier_runs_failures_are_never_tried_again() -> None:
    # The re-run met an OOM at 8 anyway (say, other work on the GPU): the store's 16 failed, so
    # nothing at or above 16 is proposed, whatever the line predicts.
    tuner = SizeTuner(64, 1, 0.0, memory_limit=1000, stored_failures=[Point(16, None, False)])
    tuner.points = [Point(4, 300, True), Point(2, 200, True)]  # the line: 100 + 50/sample
    assert unfit(16, tuner.stored_failures) is not None and unfit(12, tuner.stored_failures) is None
    hint = tuner.shrink_hint(32, None)
    assert hint is not None and hint.micro_batch == 8


def test_the_oom_figures_prove_only_sizes_close_to_the_failed_one() -> None:
    # 180 MB of room over 60 MB fixed, the OOM at 64 holding 175 MB and asking 16 MB: scaled to 32
    # that is 60 + (191 - 60) / 2 = 125.5 MB, under the limit: nothing proven.
    figures = OomFigures(64, 16 * MB, 175 * MB, 180 * MB, 60 * MB)
    assert not figures.proves_unfit(32) and figures.proves_unfit(63)
    assert unfit(32, [Point(64, None, False)], figures) is None
    # A request larger than the whole room: the next halving is proven not to fit, and skipped.
    huge = OomFigures(64, 220 * MB, 100 * MB, 180 * MB, 60 * MB)
    assert huge.proves_unfit(32) and not huge.proves_unfit(16)
    why = unfit(32, [], huge)
    assert why is not None and "scaled to 32" in why
    hint = shrink_after_oom([], 64, 64, 180 * MB, 0.0, oom=huge)
    assert hint is not None and hint.micro_batch == 16


def test_the_probes_oom_record_is_the_bound_the_tuner_skips_by() -> None:
    # The probe's oom record at micro-batch 64 under a 30% fraction of an 80 GiB device: 20 GiB held,
    # 30 GiB asked: scaled to 32 that is 25 GiB, over the 24 GiB cap, so 32 is skipped for 16.
    record = {"type": "oom", "device": "cuda:0", "requested_bytes": 30 * 2**30, "allocated_bytes": 20 * 2**30,
              "reserved_bytes": 21 * 2**30, "free_bytes": 2**30, "total_bytes": 80 * 2**30, "fraction": 0.3,
              "micro_batch": 64}
    figures = figures_at_oom(AllocatorOom.from_record(record), 64)
    assert figures is not None and figures.limit_bytes == int(80 * 2**30 * 0.3) and figures.micro_batch == 64
    assert unfit(32, [], figures) is not None and unfit(16, [], figures) is None
    hint = SizeTuner(64, 1, 0.0).shrink_hint(64, None, figures)  # no device sample: the cap is the room
    assert hint is not None and hint.micro_batch == 16
    # Without the request or the limit the observer saw, there is no bound.
    assert figures_at_oom(AllocatorOom.from_record({**record, "requested_bytes": None}), 64) is None
    assert figures_at_oom(None, 64) is None
