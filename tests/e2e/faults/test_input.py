"""Input that used to pass the start and fail hours later: each is one line and exit 2 at start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import oomguard

RUN = ["run", "--no-web", "--micro-batch", "8", "--grad-accum", "1"]


@pytest.mark.parametrize(("args", "needle"), [
    ([*RUN, "--resume-args", "--resume '{checkpoint}", "--", "true"], "--resume-args: "),
    ([*RUN, "--fallback-args", "--x 'y", "--", "true"], "--fallback-args: "),
    ([*RUN, "--max-restarts", "-1", "--", "true"], "--max-restarts: "),
    ([*RUN, "--checkpoint-signal", "SIGKILL", "--", "true"], "--checkpoint-signal: SIGKILL cannot"),
    ([*RUN, "--checkpoint-signal", "TERM", "--", "true"], "--checkpoint-signal: SIGTERM cannot"),
    ([*RUN, "--checkpoint-signal", "SIGSTOP", "--", "true"], "--checkpoint-signal: SIGSTOP cannot"),
    ([*RUN, "--", "no-such-trainer-xyz"], "is not found on PATH"),
    ([*RUN, "--", "./no/such/train.sh"], "does not exist"),
    ([*RUN, "--log-max-bytes", "lots", "--", "true"], "--log-max-bytes: "),
])
def test_bad_run_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    out = oomguard(*args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path) if "--" not in args else \
        oomguard(*args[:args.index("--")], "--run-dir", str(tmp_path / "run"), *args[args.index("--"):], cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    assert not (tmp_path / "run").exists(), "nothing is started or created for bad input"


def test_a_command_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    os.chmod(script, 0o644)
    out = oomguard(*RUN, "--run-dir", str(tmp_path / "run"), "--", str(script))
    assert out.returncode == 2 and "is not an executable file" in out.stderr and "chmod +x" in out.stderr


@pytest.mark.parametrize(("toml", "needle"), [
    ("micro_batch = true", "--micro-batch: bad value True"),
    ("micro_batch = 8.5", "--micro-batch: bad value 8.5"),
    ("max_restarts = -1", "--max-restarts: bad value -1"),
    ("port = true", "--port: bad value True"),
    ("hang_timeout = true", "--hang-timeout: bad value True"),
])
def test_toml_values_are_not_coerced(toml: str, needle: str, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'{toml}\ngrad_accum = 1\ncommand = ["true"]\n' + ("micro_batch = 8\n" if "micro" not in toml
                                                                         else ""))
    out = oomguard("run", "--no-web", "--config", str(config), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
