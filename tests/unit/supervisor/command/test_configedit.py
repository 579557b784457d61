"""--edit FILE:KEY=VALUE: per-attempt copies with keys set; the user's file is never written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomlkit
from support import oomguard

from oomguard.supervisor.command.configedit import apply_edits, check_edits
from oomguard.supervisor.errors import UsageError

YAML = """\
# training settings
model:
  n_layer: 2   # tiny
train:
  micro_batch_size: 16  # per device
  gradient_accumulation_steps: 4
  name: "run-a"
"""


def test_yaml_round_trip_keeps_comments_order_and_quotes(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    cfg = tmp_path / "configs" / "x.yaml"
    cfg.write_text(YAML)
    command = ["python", "train.py", "--config", "configs/x.yaml"]
    edits = check_edits(["configs/x.yaml:train.micro_batch_size={micro_batch}",
                         "configs/x.yaml:train.gradient_accumulation_steps={grad_accum}"], command, tmp_path)
    argv = apply_edits(edits, command, {"micro_batch": 8, "grad_accum": 8}, tmp_path, tmp_path / "run" / "a1")
    copy = Path(argv[-1])
    assert copy == tmp_path / "run" / "a1" / "x.yaml" and argv[:3] == command[:3]
    assert copy.read_text() == YAML.replace("16  #", "8   #").replace("steps: 4", "steps: 8")
    assert cfg.read_text() == YAML  # the user's file is untouched


def test_json_and_toml_and_the_equals_form(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"data": {"batch": 4, "name": "x"}, "lr": 0.1}))
    (tmp_path / "c.toml").write_text("# top\n[train]\nbatch = 4  # per GPU\n")
    command = ["python", "t.py", "--cfg=c.json", "c.toml"]
    edits = check_edits(["c.json:data.batch={micro_batch}", "c.json:data.name=y{attempt}",
                         "c.toml:train.batch={micro_batch}"], command, tmp_path)
    argv = apply_edits(edits, command, {"micro_batch": 2, "attempt": 3}, tmp_path, tmp_path / "out")
    assert argv[2] == f"--cfg={tmp_path / 'out' / 'c.json'}" and argv[3] == str(tmp_path / "out" / "c.toml")
    assert json.loads(Path(argv[2].split("=", 1)[1]).read_text()) == {"data": {"batch": 2, "name": "y3"}, "lr": 0.1}
    text = Path(argv[3]).read_text()
    assert text == "# top\n[train]\nbatch = 2  # per GPU\n" and tomlkit.parse(text)["train"]["batch"] == 2


@pytest.mark.parametrize("content,spec,command,needle", [
    (YAML, "x.yaml:train.micro_batch=1", ["python", "x.yaml"], "has no key 'train.micro_batch'"),
    (YAML, "x.yaml:nope.a=1", ["python", "x.yaml"], "has no key 'nope'"),
    ("a: [1, 2\n", "x.yaml:a=1", ["python", "x.yaml"], "does not parse"),
    (YAML, "x.yaml:train.micro_batch_size=1", ["python", "train.py"], "no argument of the command names"),
    (YAML, "x.yaml=1", ["python", "x.yaml"], "is not FILE:KEY=VALUE"),
    (YAML, "missing.yaml:a=1", ["python", "missing.yaml"], "cannot read"),
])
def test_bad_edits_are_one_line(tmp_path: Path, content: str, spec: str, command: list[str], needle: str) -> None:
    (tmp_path / "x.yaml").write_text(content)
    with pytest.raises(UsageError) as err:
        check_edits([spec], command, tmp_path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_cli_exits_2_at_start_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "x.yaml").write_text(YAML)
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), "--no-web", "--micro-batch", "4", "--grad-accum", "1",
                   "--edit", "x.yaml:train.batch={micro_batch}", "--", "python", "-c", "pass", "x.yaml",
                   cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("oomguard: error: --edit") and "has no key 'train.batch'" in out.stderr
