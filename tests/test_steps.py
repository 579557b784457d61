"""Progress read from the output of scripts that do not use the worker library."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.checkpoints import StepEvidence
from oomguard.supervisor.observe.progress import AttemptWatch, StepMatcher, StepSeen, compile_pattern


@pytest.mark.parametrize("line,expected", [
    ("iter 120: loss 3.2100, time 41.23ms, mfu 12.34%", StepSeen(120, None)),  # nanoGPT
    ("step 250: train loss 2.9012, val loss 3.0011", StepSeen(250, None)),  # nanoGPT eval
    (" 40%|████      | 40/100 [00:12<00:18,  3.30it/s]", StepSeen(40, 100)),  # HF Trainer's tqdm bar
    ("{'loss': 3.2, 'grad_norm': 1.1, 'learning_rate': 5e-05, 'epoch': 0.5}\r 40%|████ | 40/100 [00:12<00:18]",
     StepSeen(40, 100)),
    ("Epoch 2:  45%|████▌     | 45/100 [00:03<00:04, 13.52it/s, v_num=0, train_loss=2.31]", StepSeen(245, None)),
    ("step 00120/01000 (12.00%) | loss: 3.210000 | lrm: 1.00 | dt: 41.23ms", StepSeen(120, 1000)),  # nanochat
    ("Step: 120 / 1000, loss=2.1", StepSeen(120, 1000)),
    ("global_step=77 loss=1.0", StepSeen(77, None)),
    ("12/100 [00:01<00:09, 9.8it/s]", StepSeen(12, 100)),  # a bare tqdm bar
    ("loading data shard 3", None),
    ("saving checkpoint to out", None),
])
def test_builtin_patterns(line: str, expected: StepSeen | None) -> None:
    seen = StepMatcher().match(line.rsplit("\r", 1)[-1])
    assert seen == expected


def test_custom_pattern_first_and_validated() -> None:
    matcher = StepMatcher(r"it=(?P<step>\d+) of (?P<total>\d+)")
    assert matcher.match("it=5 of 9 step 3") == StepSeen(5, 9)
    with pytest.raises(ValueError, match="named group 'step'"):
        compile_pattern(r"it=(\d+)")
    with pytest.raises(ValueError, match="not a regular expression"):
        compile_pattern(r"it=(?P<step>\d+")


def test_watch_counts_steps_going_up_and_output_alone_is_not_progress() -> None:
    watch = AttemptWatch()
    watch.feed_line("iter 10: loss 3.0")
    first = watch.last_progress
    watch.feed_line("iter 11: loss 3.0")
    watch.feed_line("iter 11: loss 3.0")  # repeated: not a new step
    watch.feed_line("some warning")
    assert watch.last_step == 11 and watch.output_steps == 2 and watch.progressed
    # steps are known, so a chatty worker without new steps hangs: output does not reset the clock
    now = watch.last_progress + 100
    assert (watch.hang_reason(last_output=now, timeout=50, now=now) or "").startswith("no progress for 100 s")
    assert first <= watch.last_progress


def test_without_steps_output_still_counts() -> None:
    watch = AttemptWatch()
    watch.feed_line("hello")
    now = watch.last_progress + 100
    assert watch.hang_reason(last_output=now - 1, timeout=50, now=now) is None


def test_bars_an_eval_bar_is_ignored_and_a_longer_bar_takes_over() -> None:
    watch = AttemptWatch()
    watch.feed_line("Loading checkpoint shards: 100%|██████████| 2/2 [00:00<00:00]")
    watch.feed_line(" 10%|█         | 10/100 [00:01<00:09, 9.8it/s]")
    watch.feed_line("100%|██████████| 5/5 [00:00<00:00, 30.1it/s]")  # evaluation
    watch.feed_line(" 20%|██        | 20/100 [00:02<00:08, 9.8it/s]")
    assert watch.last_step == 20 and watch.progress is not None and watch.progress["total_steps"] == 100


def test_eta_and_the_step_a_checkpoint_was_written_at() -> None:
    watch = AttemptWatch()
    watch.note_step(StepSeen(100, 1000), now=10.0, wall=1000.0)
    watch.note_step(StepSeen(200, 1000), now=20.0, wall=1010.0)
    assert watch.progress is not None and watch.progress["eta_s"] == pytest.approx(80.0)
    assert watch.step_at(1005.0) == 100 and watch.step_at(1009.9) == 200 and watch.step_at(999.0) is None


def test_the_total_outlives_the_journaled_progress_record() -> None:
    watch = AttemptWatch()
    watch.feed_line(" 10%|█         | 10/100 [00:01<00:09, 9.8it/s]")
    watch.progress = None  # the loop journals it with the next sample and clears it
    watch.feed_line("100%|██████████| 5/5 [00:00<00:00, 30.1it/s]")  # evaluation: still ignored
    watch.feed_line(" 11%|█         | 11/100 [00:01<00:09, 9.8it/s]")
    assert watch.last_step == 11 and watch.progress is not None and watch.progress["total_steps"] == 100


def test_a_checkpoint_rewritten_at_a_later_step_is_progress_the_same_step_is_not(tmp_path: Path) -> None:
    from oomguard.supervisor.record.journal import Journal

    journal = Journal(tmp_path)
    ckpt = str(tmp_path / "out" / "ckpt.pt")
    assert journal.checkpoint_seen(ckpt, 3, 100.0, 1)
    assert not journal.checkpoint_seen(ckpt, None, 100.0, None)  # seen again, unchanged
    assert not journal.checkpoint_seen(ckpt, 3, 110.0, 2)  # nanoGPT re-saves at once after resuming
    assert journal.checkpoint_seen(ckpt, 6, 120.0, 2)  # a later step: progress
    assert [(c["step"], c["mtime"]) for c in journal.checkpoints()] == [(6, 120.0)]
    # Rewritten again, and seen only once its step can no longer be told (at the restart): the file's
    # step is unknown now, not the 6 it held before.
    assert journal.checkpoint_seen(ckpt, None, 130.0, None)
    assert [(c["step"], c["mtime"], c["attempt"]) for c in journal.checkpoints()] == [(None, 130.0, None)]
    assert [(w["step"], w["mtime"]) for w in journal.checkpoint_writes()] == [
        (3, 100.0), (3, 110.0), (6, 120.0), (None, 130.0)]
    journal.close()


def test_stable_running_for_grow_after_counts_from_the_first_step() -> None:
    watch = AttemptWatch()
    assert watch.running_since() == watch.started  # no steps known: from the start
    watch.note_step(StepSeen(1, None), now=watch.started + 40.0, wall=0.0)  # 40 s loading the model
    assert watch.running_since() == watch.started + 40.0


@pytest.mark.parametrize("line", [
    # what the issue saw read as step 4 after a resume, and its kin: numbers of files, not of training
    "Restoring states from the checkpoint path at ckpts/epoch=0-step=4.ckpt",
    "Restored all states from the checkpoint at /tmp/run/epoch=0-step=4.ckpt",
    "saved epoch=0-step=4.ckpt",
    "[transformers] Saving model checkpoint to out/checkpoint-500",
    "[transformers] Deleting older checkpoint [out/checkpoint-500] due to args.save_total_limit",
    "[transformers]   Continuing training from global step 500",
    "Resuming optimization from step 250",
    "Resumed from checkpoint: out/step_4",
    "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 180.33it/s]",
    "Sanity Checking DataLoader 0: 100%|██████████| 2/2 [00:00<00:00,  3.91it/s]",
    "Validation DataLoader 0:  50%|█████     | 1/2 [00:00<00:00, 11.81it/s]\x1b[A",
    "{'loss': '9.636', 'grad_norm': '0.2173', 'learning_rate': '0.001', 'epoch': '0.1667'}",  # 'epoch' is no step
    "{'train_runtime': '11.8', 'train_steps_per_second': '0.509', 'train_loss': '9.637', 'epoch': '1'}",
])
def test_no_step_from_paths_file_names_or_checkpoint_messages(line: str) -> None:
    assert StepMatcher().match(line) is None


def test_a_bar_glued_to_a_checkpoint_message_still_gives_its_step() -> None:
    line = " 33%|███▎      | 2/6 [00:03<00:07,  1.81s/it][transformers] Saving model checkpoint to out/checkpoint-2"
    assert StepMatcher().match(line) == StepSeen(2, 6)


@pytest.mark.parametrize(("line", "per_step", "expected"), [
    # Lightning counts batches within an epoch; with accumulation 2 four batches are two optimizer steps
    ("Epoch 1/2  ━━━━━━━╸━━━━━━━━━ 4/8 0:00:02 • 0:00:03 1.69it/s v_num: 0.000", 2, StepSeen(6, 12)),
    ("\x1b[2KEpoch 1/2  \x1b[35m━━━━━━\x1b[0m\x1b[90m╺━━━━━━━\x1b[0m 4/8 \x1b[2m0:00:02 • 0:00:03\x1b[0m", 2,
     StepSeen(6, 12)),  # the same bar rendered for a terminal
    ("Epoch 2/-1  ━━━━━━━━━━━━━━━━━ 8/8 0:00:04 • 0:00:00", 4, StepSeen(6, None)),  # no epoch limit: no total
    ("Epoch 1:  50%|█████     | 4/8 [00:01<00:01,  3.70it/s, v_num=0, train_loss=0.943]", 2, StepSeen(6, None)),
])
def test_lightning_bars_in_optimizer_steps(line: str, per_step: int, expected: StepSeen) -> None:
    assert StepMatcher(batches_per_step=per_step).match(line) == expected


def test_a_checkpoint_takes_the_step_of_the_probes_save_not_the_last_step_record() -> None:
    """The failure seen end to end: step records come at most every half second, so the last one
    before nanoGPT's ckpt.pt was written said step 1 while the save was made after step 3 (the
    report said it resumed from step 1). The probe's ``save`` record brackets the file's mtime."""
    watch = AttemptWatch()
    watch.take({"type": "step", "t": 100.0, "step": 1, "steps": 1, "pid": 7}, 0.0)
    assert watch.step_at(100.3) == 1  # without the save record: only the lower bound
    assert not watch.take({"type": "save", "t": 100.32, "started": 100.3, "step": 3, "path": None, "pid": 7}, 0.0)
    watch.take({"type": "step", "t": 100.5, "step": 4, "steps": 3, "pid": 7}, 0.0)
    watch.take({"type": "save", "t": 100.35, "started": 100.34, "step": 4, "path": None, "pid": 7}, 0.0)
    assert watch.step_at(100.31) == 3 and watch.step_at(100.28) == 3  # the mtime's coarse clock lags a tick
    assert watch.step_at(100.34) == 4  # two saves near: the one running at the mtime
    assert watch.step_at(100.2) == 1 and watch.step_at(100.6) == 4  # no save then: the step records
    # nanoGPT re-saves right after resuming, before the first step reads the resumed count: no step
    # from the save (its count would say 0), the output's or step records' stand.
    watch.take({"type": "save", "t": 100.61, "started": 100.6, "step": None, "path": None, "pid": 7}, 0.0)
    assert watch.step_at(100.6) == 4


def save(path: str | None, began: float, returned: float, step: int | None) -> dict:  # type: ignore[type-arg]
    return {"type": "save", "t": returned, "started": began, "step": step, "path": path, "pid": 7}


def test_a_checkpoints_step_is_its_own_saves_the_file_or_a_file_inside_its_directory(tmp_path: Path) -> None:
    """The probe's save record names the file: a file takes the save whose run holds its mtime (a
    rewrite of nanoGPT's ckpt.pt takes its own), a directory the newest save into it by its mtime
    (HF writes trainer_state.json after optimizer.pt, so the directory's mtime is later)."""
    watch = AttemptWatch()
    ckpt, hf = str(tmp_path / "ckpt.pt"), tmp_path / "checkpoint-500"
    watch.take(save(ckpt, 100.0, 100.2, 40), 0.0)
    watch.take(save(str(hf / "optimizer.pt"), 101.0, 101.5, 500), 0.0)
    watch.take(save(str(tmp_path / "checkpoint-5000" / "optimizer.pt"), 101.6, 101.7, 5000), 0.0)
    watch.take(save(ckpt, 102.0, 102.2, 80), 0.0)
    watch.take(save(ckpt, 103.0, 103.2, None), 0.0)  # before this process's first step: no step
    assert watch.saved_step(ckpt, 100.1, directory=False) == 40
    assert watch.saved_step(ckpt, 102.23, directory=False) == 80  # a coarse clock's tick after it returned
    assert watch.saved_step(ckpt, 103.1, directory=False) is None  # the save that wrote it said no step
    assert watch.saved_step(str(hf), 101.9, directory=True) == 500  # not checkpoint-5000's, a longer name
    assert watch.saved_step(str(hf), 100.5, directory=True) is None  # written before any save into it
    assert watch.saved_step(str(hf / "optimizer.pt"), 101.2, directory=False) == 500
    assert watch.saved_step(str(tmp_path / "other.pt"), 100.1, directory=False) is None
    link = tmp_path / "run"
    link.symlink_to(tmp_path, target_is_directory=True)
    assert watch.saved_step(str(link / "ckpt.pt"), 100.1, directory=False) == 40  # the same file by another path


def test_a_checkpoint_saved_under_a_temp_name_and_renamed_takes_that_saves_step(tmp_path: Path) -> None:
    """Atomic writers torch.save to a temp name and rename it into place (nanoGPT-style
    ``ckpt.pt.tmp``, ``.step_2.pt.tmp``, accelerate-style ``.step_4.tmp/``, ``tmp-checkpoint-6/``):
    the save record names the temp path, the index only ever sees the final one, and a rename keeps
    the mtime. The save's measured step must still count, above a name that says another (step_800,
    micro-batches under accumulation 4) and above the step reported at the mtime."""
    watch = AttemptWatch()
    watch.take(save(str(tmp_path / "ckpt.pt.tmp"), 100.0, 100.2, 3), 0.0)
    watch.take(save(str(tmp_path / ".step_800.pt.tmp"), 101.0, 101.2, 200), 0.0)
    watch.take(save(str(tmp_path / ".step_4.tmp" / "optimizer.bin"), 102.0, 102.2, 4), 0.0)
    watch.take(save(str(tmp_path / "tmp-checkpoint-6" / "optimizer.pt"), 103.0, 103.2, 6), 0.0)
    watch.take(save(str(tmp_path / "other.pt.tmp"), 104.0, 104.2, 9), 0.0)
    assert watch.saved_step(str(tmp_path / "ckpt.pt"), 100.1, directory=False) == 3
    assert watch.saved_step(str(tmp_path / "step_800.pt"), 101.1, directory=False) == 200
    assert watch.saved_step(str(tmp_path / "step_4"), 102.3, directory=True) == 4
    assert watch.saved_step(str(tmp_path / "checkpoint-6"), 103.3, directory=True) == 6
    # Another file's temp, a temp in another directory, or the temp's own name are not this file's.
    assert watch.saved_step(str(tmp_path / "ckpt.pt"), 104.1, directory=False) is None
    assert watch.saved_step(str(tmp_path / "sub" / "ckpt.pt"), 100.1, directory=False) is None
    assert watch.saved_step(str(tmp_path / "step_40"), 102.3, directory=True) is None


def test_the_save_record_beats_the_name_and_the_name_beats_the_step_at_its_mtime() -> None:
    """accelerate's ``step_{overall_step}`` counts micro-batches: with accumulation 4 its step_800
    holds optimizer step 200, the count every other step oomguard reports is in."""
    named = StepEvidence(800, ckptstep.NAME)
    assert ckptstep.resolve(200, named, 199) == StepEvidence(200, ckptstep.SAVE)
    assert ckptstep.resolve(None, named, 199) == named
    assert ckptstep.resolve(None, StepEvidence(None, None), 199) == StepEvidence(199, ckptstep.OUTPUT)
    assert ckptstep.resolve(None, StepEvidence(None, None), None) == StepEvidence(None, None)
