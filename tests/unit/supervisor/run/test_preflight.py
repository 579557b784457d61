"""The wiring between oomguard and a script, piece by piece: what is checked at start (the script, its
settings files, how a checkpoint reaches it), the verdict on each resume, the files that look like
checkpoints, the cause line's scaling, how an exit is worded and what the report counts. The same
mistakes end to end, with real processes and a real allocator OOM, are in tests/e2e/test_wiring.py."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import oomguard

from oomguard.supervisor.config import build_config
from oomguard.supervisor.decide.attribution import Evidence, Plateau, attribute, earlier_plateaus
from oomguard.supervisor.lifecycle import UsageError, exit_text
from oomguard.supervisor.observe.checkpoints import (
    QUIET_LIMIT,
    Lookalike,
    LookalikeWatcher,
    ResumeCheck,
    candidate,
    final_path,
    held_for_writing,
    matched,
    missed,
    missed_notice,
    output_dirs,
    quiet_stop_race,
    suggest_glob,
    unmatched_notice,
)
from oomguard.supervisor.observe.progress import AttemptWatch, StepSeen
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.picture import CLOSED_INTERRUPTED, closing, stopped_by
from oomguard.supervisor.record.report import build_report, format_report
from oomguard.supervisor.record.status import format_status, status_document
from oomguard.supervisor.run import preflight
from oomguard.supervisor.run import preflight as steering
from oomguard.supervisor.run import preflight as wiring
from oomguard.supervisor.run.preflight import unrecognized
from oomguard.supervisor.sizing.trend import Reading

ROOT = Path(__file__).resolve().parents[4]
EXAMPLES = ROOT / "examples"
PY = sys.executable
MIB = 2**20


def config(*options: str, command: list[str]) -> object:
    """A RunConfig from options as they are typed (argparse's names: micro_batch, checkpoints...)."""
    names = {"--micro-batch": "micro_batch", "--grad-accum": "grad_accum", "--checkpoint": "checkpoints",
             "--resume-args": "resume_args", "--edit": "edits", "--resumes-itself": "resumes_itself"}
    given: dict[str, object] = {"micro_batch": "8", "grad_accum": "1"}
    it = iter(options)
    for flag in it:
        name = names[flag]
        if name == "resumes_itself":
            given[name] = True
        elif name in ("checkpoints", "edits"):
            given.setdefault(name, [])
            given[name].append(next(it))  # type: ignore[attr-defined]
        else:
            given[name] = next(it)
    return build_config(given, command)


def check(cwd: Path, *options: str, command: list[str]) -> None:
    preflight.check(config(*options, command=command), cwd)  # type: ignore[arg-type]


# --- what the command runs ----------------------------------------------------------------------


@pytest.mark.parametrize(("command", "kind", "name"), [
    (["python", "train.py", "--lr", "3"], "file", "train.py"),
    (["python3.11", "-u", "-X", "dev", "-Wignore", "train.py"], "file", "train.py"),
    (["python", "-m", "scripts.base_train", "--x=1"], "module", "scripts.base_train"),
    (["python", "-mscripts.base_train"], "module", "scripts.base_train"),
    (["torchrun", "--nproc-per-node", "2", "train.py", "--x"], "file", "train.py"),
    (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "pkg.train"], "module", "pkg.train"),
    (["./train.sh", "--x"], "program", "./train.sh"),
    (["torchrun", "--no-python", "--nproc-per-node", "2", "trainer-bin"], "program", "trainer-bin"),
    (["bash", "train.sh"], "file", "train.sh"),
    (["accelerate", "launch", "--num_processes", "2", "train.py"], "file", "train.py"),
])
def test_the_script_is_found_through_interpreters_and_launchers(command: list[str], kind: str, name: str) -> None:
    script = wiring.script_of(command)
    assert script is not None and (script.kind, script.name) == (kind, name)


@pytest.mark.parametrize("command", [["python", "-c", "print(1)"], ["true"], ["python"]])
def test_no_script_when_there_is_none(command: list[str]) -> None:
    assert wiring.script_of(command) is None


def test_settings_files_are_positional_or_config_options_never_outputs() -> None:
    args = ["config/train_gpt2.py", "--batch_size=12", "--config", "c.yaml", "--config_file=d.json",
            "--output", "out.json", "--out_dir=x.toml", "+experiment=e.yaml", "{run_dir}/x.yaml"]
    assert list(wiring.settings_files(args)) == ["config/train_gpt2.py", "c.yaml", "d.json", "{run_dir}/x.yaml"]


# --- checked at start: files -------------------------------------------------------------------


def test_a_script_that_does_not_exist_is_named_with_the_near_miss(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    with pytest.raises(UsageError) as caught:
        check(tmp_path, command=[PY, "trian.py"])
    assert str(caught.value) == (f"COMMAND: the script trian.py does not exist (in {tmp_path}); "
                                 "check the path: did you mean train.py?")


def test_a_settings_file_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "train_gpt2.py").write_text("")
    check(tmp_path, command=[PY, "train.py", "config/train_gpt2.py", "--batch_size={micro_batch}"])
    with pytest.raises(UsageError, match=r"a file the command names config/trian_gpt2.py does not exist .*"
                                         r"did you mean config/train_gpt2.py\?"):
        check(tmp_path, command=[PY, "train.py", "config/trian_gpt2.py"])


# --- checked at start: how the checkpoint reaches the script --------------------------------------


ARGPARSE = "import argparse\nargparse.ArgumentParser().add_argument('--resume')\n"


def test_checkpoints_nothing_hands_over_are_refused(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(ARGPARSE + "# oomguard is only named in a comment\n")
    with pytest.raises(UsageError) as caught:
        check(tmp_path, "--checkpoint", "out/step-*.pt", command=[PY, "train.py", "--batch-size", "{micro_batch}"])
    assert str(caught.value) == (
        "--checkpoint: 'out/step-*.pt' is watched, but nothing hands the checkpoint to the script, so every restart "
        "would start over at step 1 (no {checkpoint} or {checkpoint_step} in the command, no --resume-args or "
        "--edit, and train.py does not use oomguard's worker library); add your script's resume flag, e.g. "
        "--resume-args '--resume {checkpoint}', or --resumes-itself if the script finds its checkpoint by itself")


@pytest.mark.parametrize("options", [
    ("--resume-args", "--resume {checkpoint}"),  # the plain form
    ("--resume-args", "--init_from=resume"),  # nanoGPT: a fixed out/ckpt.pt, told to resume
    ("--resume-args", "--resume_from_checkpoint {checkpoint}"),  # Hugging Face
    ("--resume-args", "--resume_from_step={checkpoint_step}"),  # nanochat
    ("--resumes-itself",),  # the user's word
])
def test_every_way_of_handing_the_checkpoint_over_starts(tmp_path: Path, options: tuple[str, ...]) -> None:
    (tmp_path / "train.py").write_text(ARGPARSE)
    check(tmp_path, "--checkpoint", "out/*", *options, command=[PY, "train.py", "--bs", "{micro_batch}"])


def test_a_checkpoint_placeholder_in_the_command_or_an_edit_hands_it_over(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(ARGPARSE)
    (tmp_path / "c.yaml").write_text("resume: null\n")
    check(tmp_path, "--checkpoint", "out/*",
          command=[PY, "train.py", "--init", "{checkpoint}", "--bs", "{micro_batch}"])
    check(tmp_path, "--checkpoint", "out/*", "--edit", "c.yaml:resume={checkpoint}",
          command=[PY, "train.py", "--config", "c.yaml", "--bs", "{micro_batch}"])


def test_the_worker_library_hands_it_over_itself(tmp_path: Path) -> None:
    """The form docs/worker.md shows: --checkpoint and nothing else, the Session resumes."""
    check(ROOT, "--checkpoint", "out/ckpt/checkpoint-*",
          command=[PY, str(EXAMPLES / "train_worker_demo.py"), "--checkpoint-dir", "out/ckpt"])
    # in a module the script imports, or read from the protocol's variables, or run by a shell script
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("")
    (tmp_path / "helpers" / "loop.py").write_text("from oomguard import Session\n")
    (tmp_path / "train.py").write_text("import torch\nfrom helpers.loop import Session\n")
    (tmp_path / "env.py").write_text("import os\nstep = int(os.environ.get('OOMGUARD_CHECKPOINT_STEP') or 0)\n")
    (tmp_path / "train.sh").write_text(f"#!/bin/sh\nexec {PY} train.py \"$@\"\n")
    (tmp_path / "train.sh").chmod(0o755)
    for command in ([PY, "train.py"], [PY, "env.py"], ["./train.sh"], [PY, "-m", "train"]):
        check(tmp_path, "--checkpoint", "out/*", command=command)


def test_a_library_name_in_a_comment_or_another_variable_does_not_count(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import os\n# uses oomguard\nr = os.environ['OOMGUARD_CHECKPOINT_REQUEST']\n")
    with pytest.raises(UsageError, match="does not use oomguard's worker library"):
        check(tmp_path, "--checkpoint", "out/*", command=[PY, "train.py"])


def test_a_script_that_cannot_be_read_is_refused_with_the_same_fix(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="could not be read to see whether it uses oomguard's worker library"):
        check(tmp_path, "--checkpoint", "out/*", command=[PY, "-m", "no_such_module_xyz"])


def test_resumes_itself_needs_checkpoints() -> None:
    with pytest.raises(UsageError, match="--resumes-itself: is given but no --checkpoint is watched"):
        config("--resumes-itself", command=["true"])


@pytest.mark.parametrize(("options", "hint"), [
    (("--resume-args", "--resume {checkpoint}"), "check --resume-args"),
    (("--resumes-itself",), "--resumes-itself says the script finds its checkpoint by itself, but it did not load"),
    ((), "check that the script resumes"),
])
def test_the_hint_names_how_this_run_hands_the_checkpoint_over(options: tuple[str, ...], hint: str) -> None:
    assert wiring.resume_hint(config("--checkpoint", "out/*", *options, command=["true"])).startswith(hint)  # type: ignore[arg-type]


# --- a command line with its -- forgotten -----------------------------------------------------------


def test_an_unknown_argument_that_is_a_command_says_where_the_dashes_go() -> None:
    assert unrecognized(["python", "train.py", "--lr", "3"], ["--micro-batch"], "run") == (
        "unrecognized arguments: python train.py --lr 3; put -- before the training command: "
        "oomguard run [options] -- python train.py --lr 3")
    assert unrecognized(["--micro-bach", "32"], ["--micro-batch", "--grad-accum"], "run") == (
        "unrecognized arguments: --micro-bach 32 (did you mean --micro-batch?)")
    assert unrecognized(["8"], ["--micro-batch"], "run") == "unrecognized arguments: 8"


def test_the_suggested_line_keeps_every_word_typed_also_for_an_ambiguous_option() -> None:
    """The script's own flags argparse took as oomguard's (--port 9000) stay in the suggestion."""
    from oomguard.supervisor.cli import main

    typed = ["--micro-batch", "64", "--global-batch", "128", "python", "train.py", "--port", "9000", "--tag", "a b"]
    assert unrecognized(["python", "train.py", "--tag", "a b"], [], "run", typed).endswith(
        "put -- before the training command: oomguard run --micro-batch 64 --global-batch 128 -- python train.py "
        "--port 9000 --tag 'a b'")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["run", "--run-dir", "runs/x", "--micro-batch", "8", "--grad-accum", "1", "python", "train.py",
                     "--resume", "x.pt"])
    assert code == 2
    assert err.getvalue() == (
        "oomguard: error: ambiguous option: --resume could match --resume-args, --resumes-itself; if --resume is the "
        "training script's, put -- before the training command: oomguard run --run-dir runs/x --micro-batch 8 "
        "--grad-accum 1 -- python train.py --resume x.pt; see 'oomguard run --help'\n")


# --- did the attempt resume? ---------------------------------------------------------------------


def test_the_first_step_that_counts_decides() -> None:
    check_ = ResumeCheck("/o/step-6.pt", 6)
    check_.see(0, 100)  # a bar drawn at 0/100 before a resumed Trainer moves it
    check_.see(1, 2)  # Loading checkpoint shards 1/2: a bar no longer than the step reached
    assert check_.verdict is None
    check_.see(1, 10)
    check_.see(7, 10)
    verdict = check_.verdict
    assert verdict is not None and not verdict.resumed and verdict.first_step == 1
    assert verdict.message("check --resume-args") == "the script started over at step 1, not from step-6.pt: " \
                                                     "check --resume-args"


@pytest.mark.parametrize(("first", "resumed"), [(7, True), (6, True), (5, True), (4, False), (3, False)])
def test_numbering_conventions_are_a_resume_two_steps_back_is_not(first: int, resumed: bool) -> None:
    check_ = ResumeCheck("/o/step-6.pt", 6)
    check_.see(first)
    verdict = check_.verdict
    assert verdict is not None and verdict.resumed is resumed
    if not resumed:
        assert verdict.message("h") == (f"the script went back to step {first}, not on from step-6.pt (step 6): "
                                        f"{6 - first + 1} step(s) redone; h")


def test_the_attempt_feeds_output_steps_and_worker_records_to_the_check() -> None:
    from_output, from_records = AttemptWatch(), AttemptWatch()
    from_output.resume, from_records.resume = ResumeCheck("/c", 40), ResumeCheck("/c", 40)
    from_output.feed_line("step 41/100 loss 2.0")
    from_records.take({"type": "progress", "step": 2, "t": time.time()}, time.monotonic())
    assert from_output.resume.verdict is not None and from_output.resume.verdict.resumed
    assert from_records.resume.verdict is not None and not from_records.resume.verdict.resumed
    from_output.note_step(StepSeen(1, 100), time.monotonic(), time.time())  # later steps change nothing
    assert from_output.resume.verdict.first_step == 41


# --- files that look like checkpoints --------------------------------------------------------------


@pytest.mark.parametrize(("rel", "is_dir", "expected"), [
    ("out/step-4.pt", False, "out/step-4.pt"),
    ("out/checkpoint-10/model.safetensors", False, "out/checkpoint-10"),
    ("out/checkpoint-10", True, "out/checkpoint-10"),
    ("ds/global_step100/mp_rank_00.bin", False, "ds/global_step100"),
    ("base/d20/model_000100.pt", False, "base/d20/model_000100.pt"),
    ("out/.checkpoint-4.tmp/state.pt", False, None),  # being written
    ("out/step-4.pt.partial", False, None),
    (".venv/lib/torch/x.pt", False, None),
    ("out/log.txt", False, None),
    ("out", True, None),
])
def test_what_looks_like_a_checkpoint(rel: str, is_dir: bool, expected: str | None) -> None:
    found = candidate(f"/w/{rel}", "/w", is_dir)
    assert found == (None if expected is None else f"/w/{expected}")


def test_the_suggested_glob_and_the_output_directories(tmp_path: Path) -> None:
    assert suggest_glob([str(tmp_path / f"out/step-{n}.pt") for n in (2, 4, 6)], tmp_path) == "out/step-*.pt"
    assert suggest_glob(["/scratch/r/checkpoint-10", "/scratch/r/checkpoint-20"], tmp_path) == \
        "/scratch/r/checkpoint-*"
    command = ["python", "t.py", "--output_dir", "out", "--save-dir=/scratch/r", "--out_file", "o/m.pt",
               "--output", "{run_dir}/x", "--batch-size", "8"]
    assert output_dirs(command, tmp_path) == [tmp_path / "out", Path("/scratch/r"), tmp_path / "o"]


def test_when_a_glob_that_matches_nothing_is_said() -> None:
    cwd, t = Path("/w"), 1000.0
    files = [Lookalike("/w/out/step-2.pt", t), Lookalike("/w/out/step-4.pt", t + 2)]
    assert missed_notice(["checkpoints/*.pt"], files, False, cwd) == (
        "--checkpoint 'checkpoints/*.pt' matches nothing, but the script wrote out/step-2.pt, out/step-4.pt: "
        "a restart would start over; use --checkpoint 'out/step-*.pt'")
    assert missed_notice(["out/ckpt-*.pt"], files[:1], True, cwd).startswith(
        "--checkpoint 'out/ckpt-*.pt' does not match out/step-2.pt, which the script wrote")
    # a file in a matched checkpoint directory, an absolute glob, a recursive one: matched
    assert matched("/w/out/checkpoint-5", ["out/checkpoint-*"], cwd)
    assert matched("/w/out/checkpoint-5/model.safetensors", ["out/checkpoint-*"], cwd)
    assert matched("/scratch/run/step_10.pt", ["/scratch/run/step_*.pt"], cwd)
    assert matched("/w/ck/a/b/step-3.pt", ["ck/**/*.pt"], cwd)
    assert not matched("/w/ckpts4/step-5.pt", ["ckpts/step-*.pt"], cwd)
    # which are said: one outside the globs' directories at once; one beside the watched files (nanochat's
    # optim_N.pt next to model_N.pt) is part of a checkpoint once the globs match, else said once settled
    optim, elsewhere = Lookalike("/w/out/optim_5.pt", t), Lookalike("/w/ckpts4/step-5.pt", t)
    globs = ["out/model_*.pt"]
    assert missed([optim, elsewhere], globs, cwd, True, None, t) == [elsewhere]
    assert missed([optim], globs, cwd, False, t + 1, t + 1) == []  # too fresh: the index may count model_5.pt yet
    assert missed([optim], globs, cwd, False, t + 1, t + 3) == [optim]
    assert missed([optim], globs, cwd, True, t + 1, t + 60) == []
    assert unmatched_notice(["ckpts/*.pt"], t, 5, t + QUIET_LIMIT - 10, cwd, [cwd]) is None
    assert unmatched_notice(["ck/*.pt"], t, 4000, t + QUIET_LIMIT, cwd, [cwd, cwd / "out"]) == (
        "--checkpoint 'ck/*.pt' has matched nothing in 30 min of training (to step 4000), and nothing that looks "
        "like a checkpoint was written in ., out: a restart would start over; check the glob, and that the script "
        "saves checkpoints")
    # files another process wrote there do not make "nothing was written" true, nor are they the script's
    assert unmatched_notice(["ck/*.pt"], t, 4000, t + QUIET_LIMIT, cwd, [cwd], others=True) == (
        "--checkpoint 'ck/*.pt' has matched nothing in 30 min of training (to step 4000), and the script was not "
        "seen writing anything that looks like a checkpoint in .: a restart would start over; check the glob, and "
        "that the script saves checkpoints")


@pytest.mark.parametrize(("rel", "final"), [
    ("out/.step-4.pt.tmp", "out/step-4.pt"),
    ("out/.step_4.tmp/model.pt", "out/step_4/model.pt"),
    ("tmp-checkpoint-6/optimizer.pt", "checkpoint-6/optimizer.pt"),
    ("ckpt.pt.tmp", "ckpt.pt"),
    ("out/.hidden/model.pt", "out/.hidden/model.pt"),  # hidden, not being written: no other file's name
    ("out/step-4.pt", "out/step-4.pt"),
])
def test_a_saved_file_as_an_atomic_writer_renames_it(rel: str, final: str) -> None:
    assert final_path(rel) == final


def test_the_watcher_sees_what_the_worker_writes_with_inotify(tmp_path: Path) -> None:
    (tmp_path / "data" / "shard-1").mkdir(parents=True)  # an input: not watched below cwd's first level
    (tmp_path / "checkpoints").mkdir()  # named like an output: watched
    run_dir = tmp_path / "oomguard-run"
    run_dir.mkdir()
    watcher = LookalikeWatcher(tmp_path, [], [run_dir])
    assert watcher.roots == [tmp_path / "checkpoints"]
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while watcher._observer is None and time.monotonic() < deadline:
            time.sleep(0.05)
        (tmp_path / "out").mkdir()  # created by the worker: watched from the next look on
        (tmp_path / "model-final.safetensors").write_bytes(b"x")
        (run_dir / "step-1.pt").write_bytes(b"x")  # oomguard's own
        (tmp_path / "checkpoints" / ".tmp-x").mkdir()
        (tmp_path / "checkpoints" / ".tmp-x" / "state.pt").write_bytes(b"x")
        os.rename(tmp_path / "checkpoints" / ".tmp-x", tmp_path / "checkpoints" / "checkpoint-3")
        time.sleep(0.5)
        watcher.found()  # schedules out/
        (tmp_path / "out" / "step-2.pt").write_bytes(b"x")
        expected = {str(tmp_path / p) for p in ("out/step-2.pt", "model-final.safetensors", "checkpoints/checkpoint-3")}
        while {f.path for f in watcher.found()} != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {f.path for f in watcher.found()} == expected
    finally:
        watcher.stop()


HOLD = "import sys, time; sys.stdin.readline(); f = open(sys.argv[1], sys.argv[2]); " \
       "f.write(b'x') if 'w' in sys.argv[2] else None; f.flush(); print('open', flush=True); time.sleep(60)"


def holding(path: Path, mode: str, procs: list[subprocess.Popen[str]] | None = None) -> subprocess.Popen[str]:
    """A real process that holds ``path`` open (``wb``: written, ``rb``: read) until killed; added to
    ``procs`` before it opens the file (the watcher looks at once)."""
    proc = subprocess.Popen([PY, "-c", HOLD, str(path), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    if procs is not None:
        procs.append(proc)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "open\n"
    return proc


def test_a_file_is_held_for_writing_only_by_a_process_that_opened_it_so(tmp_path: Path) -> None:
    written, read = tmp_path / "a.pt", tmp_path / "b.pt"
    read.write_bytes(b"x")
    writer, reader = holding(written, "wb"), holding(read, "rb")
    try:
        paths = {str(written), str(read)}
        assert held_for_writing([writer.pid, reader.pid], paths) == {str(written)}
        assert held_for_writing([reader.pid], paths) == set()  # reading a checkpoint is no write of it
        assert held_for_writing([os.getpid()], paths) == set()  # a process that does not hold it
    finally:
        for proc in (writer, reader):
            proc.kill()
            proc.wait()
    assert held_for_writing([writer.pid], {str(written)}) == set()  # gone


def test_a_lookalike_is_the_workers_only_by_its_save_record_or_its_open_file(tmp_path: Path) -> None:
    """Another process writing under the working directory (a cp, a pip install) is never the worker."""
    out = tmp_path / "out"
    out.mkdir()
    procs: list[subprocess.Popen[str]] = []
    watcher = LookalikeWatcher(tmp_path, [], [], lambda: tuple(p.pid for p in procs[:1]))  # only the first is ours
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while watcher._observer is None and time.monotonic() < deadline:
            time.sleep(0.05)
        holding(out / "held-1.pt", "wb", procs)
        procs.append(holding(out / "foreign-1.pt", "wb"))  # not ours: held open for writing by another process
        (out / "copied.pt").write_bytes(b"x")  # this process's write: not the worker's
        (out / ".step-5.pt.tmp").write_bytes(b"x")  # the worker's torch.save, renamed into place
        os.rename(out / ".step-5.pt.tmp", out / "step-5.pt")
        (out / ".step_6.tmp").mkdir()
        (out / ".step_6.tmp" / "model.pt").write_bytes(b"x")
        os.rename(out / ".step_6.tmp", out / "step_6")
        (out / ".step-7.tmp").write_bytes(b"x")  # renamed to another suffix: the rename seen says where it went
        os.rename(out / ".step-7.tmp", out / "step-7.pt")
        while str(out / "step-7.pt") not in {f.path for f in watcher.found()} and time.monotonic() < deadline:
            time.sleep(0.05)  # the renames are seen before the save records arrive, as in a run
        watcher.saved([str(out / ".step-5.pt.tmp"), str(out / ".step_6.tmp" / "model.pt"), str(out / ".step-7.tmp")])
        expected = {"held-1.pt": True, "foreign-1.pt": False, "copied.pt": False, "step-5.pt": True, "step_6": True,
                    "step-7.pt": True}
        seen: dict[str, bool] = {}
        while seen != expected and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = {os.path.basename(f.path): f.own for f in watcher.found()}
        assert seen == expected
    finally:
        watcher.stop()
        for proc in procs:
            proc.kill()
            proc.wait()


def test_watchdogs_stop_race_line_is_not_printed(caplog: pytest.LogCaptureFixture) -> None:
    quiet_stop_race()
    logger = logging.getLogger("watchdog.observers.inotify")
    logger.error("InotifyEmitter.queue_events() called when the thread is inactive")
    logger.error("a real problem")
    assert [r.getMessage() for r in caplog.records] == ["a real problem"]


# --- the cause line agrees with its figures ----------------------------------------------------------


def plateau(mib: int, seed: int) -> list[Reading]:
    rnd = random.Random(seed)
    return [Reading(float(i), min(mib * MIB, (i + 1) * mib * MIB // 4) + rnd.randint(-MIB, MIB), i * 10)
            for i in range(60)]


def test_memory_follows_the_micro_batch_only_where_measured_plateaus_do() -> None:
    earlier = [Plateau(128, 301 * MIB, False), Plateau(64, 377 * MIB, False)]
    grew = attribute(plateau(422, 3), Evidence(), 32, earlier=earlier, failed=False)
    assert "memory follows" not in grew.summary
    assert re.search(r"but memory does not follow the micro-batch: its highest readings grew as the micro-batch "
                     r"shrank \(301\.0 MiB at 128, 377\.0 MiB at 64, 42\d\.\d MiB at 32\)$", grew.summary), grew.summary
    assert grew.figures["follows"] is False
    fell = attribute(plateau(200, 3), Evidence(), 32, earlier=[Plateau(64, 400 * MIB, False)], failed=False)
    assert fell.summary.startswith("micro-batch 32 used ") and re.search(
        r"memory follows the micro-batch \(highest readings 400\.0 MiB at 64, 20\d\.\d MiB at 32\)$", fell.summary)
    one = attribute(plateau(300, 3), Evidence(), 128)
    assert one.summary.endswith("only micro-batch 128 measured so far") and "follows" not in one.summary


def test_readings_before_a_failure_are_lower_bounds_that_say_nothing_of_scaling() -> None:
    """Issue 27: plateaus read before OOMs (the ceiling, or a sample before the spike) never show that
    memory "does not follow" or "grew as the micro-batch shrank"."""
    grew = attribute(plateau(422, 3), Evidence(), 32, earlier=[(128, 301 * MIB), (64, 377 * MIB)])
    assert "follow" not in grew.summary and "grew as" not in grew.summary, grew.summary
    assert re.search(r"lower bounds \(at least 301\.0 MiB at 128, at least 377\.0 MiB at 64, "
                     r"at least 42\d\.\d MiB at 32\)", grew.summary), grew.summary
    assert grew.figures["follows"] is None and grew.figures["plateau_censored"] is True


def test_earlier_plateaus_come_from_the_journal_records() -> None:
    attributions = {1: {"plateau_bytes": 301 * MIB}, 2: {"cause": "leak"},
                    3: {"plateau_bytes": 377 * MIB, "plateau_censored": False}}
    attempts = [{"attempt": 1, "micro_batch": 128}, {"attempt": 2, "micro_batch": 64},
                {"attempt": 3, "micro_batch": 64}]
    assert earlier_plateaus(attributions, attempts) == [Plateau(128, 301 * MIB, True), Plateau(64, 377 * MIB, False)]


# --- one way to say how a process ended --------------------------------------------------------------


@pytest.mark.parametrize(("figures", "text"), [
    ((1, None, 1), "exit 1"), ((None, 9, -9), "signal 9 (SIGKILL)"), ((None, None, -15), "signal 15 (SIGTERM)"),
    ((None, None, 3), "exit 3"), ((None, None, None), "no exit recorded"), ((None, 99, None), "signal 99"),
])
def test_exit_text(figures: tuple[int | None, int | None, int | None], text: str) -> None:
    assert exit_text(*figures) == text


# --- the report counts what was really redone, and a stop is no failure -------------------------------


def test_the_report_counts_the_steps_a_missed_resume_redid(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    plan = {"micro_batch": 32, "grad_accum": 1, "global_batch": 32, "world_size": 1}
    journal.start_attempt(1, 100, plan, None, ["python", "t.py"], "a1.log")
    journal.checkpoint_seen("/w/out/step-6.pt", 6, time.time(), 1)
    journal.end_attempt(1, returncode=1, exit_code=1, kind="host_oom", evidence="DefaultCPUAllocator",
                        decision="restart", last_step=7)
    journal.start_attempt(2, 101, {**plan, "micro_batch": 16, "grad_accum": 2}, "/w/out/step-6.pt",
                          ["python", "t.py"], "a2.log")
    journal.event("resume_point", 2, path="/w/out/step-6.pt", step=6)
    message = "the script started over at step 1, not from step-6.pt: check --resume-args"
    journal.event("not_resumed", 2, path="/w/out/step-6.pt", step=6, first_step=1, message=message)
    journal.end_attempt(2, returncode=-2, decision=stopped_by(2), last_step=4)
    report = build_report(journal)
    failure = report["failures"][0]
    assert failure["steps_lost"] == 7 and report["steps_lost"] == 7
    assert failure["resumed_from"] == {"path": "/w/out/step-6.pt", "step": 6, "resumed": False, "first_step": 1}
    assert failure["lost_s"] == pytest.approx(failure["ended"] - failure["started"])  # all of it
    assert failure["exit"] == "exit 1"
    assert [s["attempt"] for s in report["stops"]] == [2] and len(report["failures"]) == 1
    text = format_report(report)
    assert ("last step 7, started over at step 1 instead of resuming from step 6 (/w/out/step-6.pt): "
            "7 step(s) redone") in text
    assert f"warning:     attempt 2: {message}" in text
    assert "attempt 2 at " in text and "stopped by SIGINT: a stop asked for, not a failure" in text
    assert "host_oom at micro-batch 32 × accum 1 (exit 1)" in text
    doc = status_document(journal)  # the same words in status, and the stop is no failure there either
    assert [(f["attempt"], f["exit"]) for f in doc["failures"]] == [(1, "exit 1")]
    assert "attempt 1: host_oom at micro-batch 32 (exit 1): DefaultCPUAllocator" in format_status(doc)
    journal.close()


def test_the_report_counts_steps_redone_whatever_started_the_next_attempt(tmp_path: Path) -> None:
    """A Ctrl-C and a rerun (24 -> 20), the user's restart (17 -> 15), a planned restart right after
    its checkpoint (nothing redone) and --grow: every redone step is in the total."""
    journal = Journal(tmp_path)
    plan = {"micro_batch": 32, "grad_accum": 1, "global_batch": 32, "world_size": 1}
    rows = [  # (ending, stop_reason, decision, last step, the step its next attempt resumed from)
        ("stopped", "user", stopped_by(2), 24, 20),
        ("planned_restart", "restart_requested", "restart requested", 37, 35),
        ("planned_restart", "memory_forecast", "planned restart after ck-45", 45, 45),
        ("grow", "grow", "grow: micro-batch 64", 52, 50),
    ]
    resumed: str | None = None
    for n, (ending, reason, decision, last, _) in enumerate(rows, 1):
        journal.start_attempt(n, 100 + n, plan, resumed, ["python", "t.py"], f"a{n}.log")
        journal.end_attempt(n, returncode=-15, ending=ending, stop_reason=reason, decision=decision, last_step=last)
        resumed = f"/w/ck-{rows[n - 1][4]}.pt"
        journal.checkpoint_seen(resumed, rows[n - 1][4], time.time(), n)
        journal.event("resume_point", n + 1, path=resumed, step=rows[n - 1][4])
    journal.start_attempt(len(rows) + 1, 200, plan, resumed, ["python", "t.py"], "last.log")
    report = build_report(journal)
    assert report["failures"] == []
    assert [(r["attempt"], r["ending"], r["steps_lost"]) for r in report["restarts"]] == [
        (1, "stopped", 4), (2, "planned_restart", 2), (3, "planned_restart", 0), (4, "grow", 2)]
    assert report["steps_lost"] == 8 and report["steps_lost_exact"]
    text = format_report(report)
    assert "steps lost (redone): 8" in text
    assert "  attempt 1 (stopped): last step 24, resumed from step 20 (/w/ck-20.pt): 4 step(s) redone" in text
    assert "attempt 3 (planned_restart)" not in text  # nothing redone: not listed
    journal.close()


def test_a_later_supervisor_closes_an_attempt_as_the_stop_that_was_asked_for() -> None:
    assert closing({"signal": "SIGTERM"}).decision == "stopped by SIGTERM: a stop asked for, not a failure"
    assert closing(None).decision == CLOSED_INTERRUPTED


# --- merged from tests/test_steering.py ---------------------------------------------------------------------
# A command oomguard cannot steer (no batch placeholder, no --edit, a script that reads nothing of
# oomguard's) is refused at start, one line and exit 2; every form that can be steered starts.


ARGPARSE_STEERING = "import argparse\np = argparse.ArgumentParser()\np.add_argument('--batch-size')\np.parse_args()\n"


def steer(cwd: Path, command: list[str], **options: object) -> None:
    steering.check_steering(build_config({"micro_batch": "8", "grad_accum": "1", **options}, command), cwd)


def test_a_script_given_no_batch_is_refused_naming_what_would_steer_it(tmp_path: Path) -> None:
    (tmp_path / "mytrain.py").write_text(ARGPARSE_STEERING)
    with pytest.raises(UsageError, match="oomguard cannot steer this command") as raised:
        steer(tmp_path, [PY, "mytrain.py", "--batch-size", "64"])
    assert "mytrain.py" in raised.value.problem
    assert "{micro_batch}" in raised.value.fix and "--edit FILE:KEY" in raised.value.fix
    assert "worker library" in raised.value.fix
    for inline in ([PY, "-c", "print(1)"], ["sh", "-c", "exec ./train --bs 64"]):  # inline code, read with the command
        with pytest.raises(UsageError, match="its inline code"):
            steer(tmp_path, inline)


@pytest.mark.parametrize("form", [
    {"command": [PY, "mytrain.py", "--batch-size", "{micro_batch}"]},
    {"command": [PY, "mytrain.py", "--batch-size", "{global_batch}"]},
    {"command": [PY, "mytrain.py", "--config", "c.yaml"], "edits": ["c.yaml:batch={micro_batch}"]},
    {"command": ["sh", "-c", "python mytrain.py --batch-size $OOMGUARD_MICRO_BATCH"]},
    {"command": [PY, "reads_env.py"]},
    {"command": [PY, "library.py"]},
    {"command": [PY, "-m", "no_such_module_xyz"]},  # cannot be read: not refused on a guess
    {"command": ["no-such-program-xyz"]},
])
def test_every_form_that_hands_the_script_its_batch_starts(tmp_path: Path, form: dict[str, object]) -> None:
    (tmp_path / "mytrain.py").write_text(ARGPARSE_STEERING)
    (tmp_path / "reads_env.py").write_text("import os\nbs = int(os.environ['OOMGUARD_MICRO_BATCH'])\n")
    (tmp_path / "library.py").write_text("from oomguard import Session\n")
    command = form.pop("command")
    steer(tmp_path, command, **form)  # type: ignore[arg-type]


def test_the_refusal_is_one_line_and_exit_2_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "mytrain.py").write_text(ARGPARSE_STEERING)
    out = oomguard("run", "--run-dir", "run", "--no-web", "--micro-batch", "64", "--global-batch", "128", "--",
                   PY, "mytrain.py", "--batch-size", "64", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("oomguard: error: COMMAND: oomguard cannot steer this command")
    assert not (tmp_path / "run").exists()
