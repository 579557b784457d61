"""A command oomguard cannot steer (no batch placeholder, no --edit, a script that reads nothing of
oomguard's) is refused at start, one line and exit 2; every form that can be steered starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import oomguard

from oomguard.supervisor.config import build_config
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.run import preflight as steering

PY = sys.executable
ARGPARSE = "import argparse\np = argparse.ArgumentParser()\np.add_argument('--batch-size')\np.parse_args()\n"


def steer(cwd: Path, command: list[str], **options: object) -> None:
    steering.check_steering(build_config({"micro_batch": "8", "grad_accum": "1", **options}, command), cwd)


def test_a_script_given_no_batch_is_refused_naming_what_would_steer_it(tmp_path: Path) -> None:
    (tmp_path / "mytrain.py").write_text(ARGPARSE)
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
    (tmp_path / "mytrain.py").write_text(ARGPARSE)
    (tmp_path / "reads_env.py").write_text("import os\nbs = int(os.environ['OOMGUARD_MICRO_BATCH'])\n")
    (tmp_path / "library.py").write_text("from oomguard import Session\n")
    command = form.pop("command")
    steer(tmp_path, command, **form)  # type: ignore[arg-type]


def test_the_refusal_is_one_line_and_exit_2_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "mytrain.py").write_text(ARGPARSE)
    out = oomguard("run", "--run-dir", "run", "--no-web", "--micro-batch", "64", "--global-batch", "128", "--",
                   PY, "mytrain.py", "--batch-size", "64", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("oomguard: error: COMMAND: oomguard cannot steer this command")
    assert not (tmp_path / "run").exists()
