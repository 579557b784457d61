"""How a command hands its script the accumulation: a script without any is never claimed to keep the
global batch (refused, or shrunk honestly with --allow-smaller-global-batch), and nanoGPT's total
accumulation gets its own placeholder and a warning when given the per-rank one (pure, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomlkit
from support import oomguard

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.command import Carrier, apply_edits, carrier, check_edits, total_warning
from oomguard.supervisor.config import build_config
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record.status import format_status
from oomguard.supervisor.run.preflight import notices
from oomguard.supervisor.run.process import placeholder_values

NANOGPT_LINES = """
ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
"""


@pytest.mark.parametrize("texts, expected", [
    (["python", "t.py", "--bs", "{micro_batch}", "--ga", "{grad_accum}"], Carrier.PLACEHOLDER),
    (["torchrun", "t.py", "--batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum_total}"],
     Carrier.PLACEHOLDER),
    (["sh", "-c", "python t.py --bs {micro_batch} --ga $OOMGUARD_GRAD_ACCUM"], Carrier.ENVIRONMENT),
    (["python", "t.py", "--bs", "{micro_batch}", "--total", "{global_batch}"], Carrier.DERIVED),
    (["python", "-m", "scripts.base_train", "--device_batch_size={micro_batch}", "--total_batch_size=524288"],
     Carrier.DERIVED),
    (["python", "t.py", "--batch_size", "{micro_batch}"], Carrier.NONE),
    (["python", "t.py"], Carrier.UNSEEN),
    (["python", "t.py", "--config", "x.yaml", "{grad_accum}"], Carrier.PLACEHOLDER),  # an --edit value
])
def test_how_the_command_carries_the_accumulation(texts: list[str], expected: Carrier) -> None:
    assert carrier(texts) is expected


NO_ACCUM = ["python", "train.py", "--batch_size", "{micro_batch}"]


def test_a_script_without_accumulation_starts_at_accumulation_1_or_not_at_all() -> None:
    config = build_config({"micro_batch": "32", "global_batch": "32"}, NO_ACCUM)
    plan = config.initial_plan
    assert (plan.global_batch, plan.grad_accum, plan.asked, plan.accumulates) == (32, 1, 32, False)
    assert not config.may_shrink
    assert build_config({"micro_batch": "32", "global_batch": "32", "allow_smaller_global_batch": True},
                        NO_ACCUM).may_shrink
    with pytest.raises(UsageError, match="--global-batch: needs accumulation 2 at micro-batch 32, but the command "
                                         "passes no {grad_accum}: the script would train at a global batch of 32"):
        build_config({"micro_batch": "32", "global_batch": "64"}, NO_ACCUM)
    with pytest.raises(UsageError, match="--allow-smaller-global-batch: is given but the command passes"):
        build_config({"micro_batch": "32", "grad_accum": "2", "allow_smaller_global_batch": True},
                     [*NO_ACCUM, "--ga", "{grad_accum}"])


def failure(micro: int) -> Failure:
    return Failure(1, FailureKind.HOST_OOM, micro, "DefaultCPUAllocator: can't allocate memory")


def test_the_policy_refuses_to_shrink_a_script_without_accumulation_but_tries_what_keeps_the_batch() -> None:
    plan = Plan(BatchPlan(32, 32, 1, asked_global=32))
    fallback = decide(failure(32), [], plan, PolicyConfig(fallback_count=1))
    assert fallback.action is Action.RESTART and fallback.plan.fallbacks_applied == 1
    assert fallback.plan.batch.micro_batch == 32 and "may not shrink" in fallback.reason
    refused = decide(failure(32), [], fallback.plan, PolicyConfig(fallback_count=1))
    assert refused.action is Action.GIVE_UP and refused.plan.batch.micro_batch == 32
    assert refused.reason == ("host_oom at micro-batch 32: the command passes no {grad_accum}, so micro-batch 16 "
                              "would shrink the global batch from 32 to 16; pass --allow-smaller-global-batch to "
                              "train at that, or put {grad_accum} where the script takes its accumulation")


def test_allowed_the_shrink_is_honest_everywhere() -> None:
    plan = Plan(BatchPlan(32, 64, 2, asked_global=64))
    shrunk = decide(failure(32), [], plan, PolicyConfig(smaller_global_batch=True))
    batch = shrunk.plan.batch
    assert (batch.micro_batch, batch.grad_accum, batch.global_batch, batch.asked) == (16, 1, 32, 64)
    assert shrunk.reason == "host_oom at micro-batch 32: micro-batch 16 × accumulation 1 × world 2 = 32 (asked 64)"
    again = decide(failure(5), [], Plan(BatchPlan(5, 10, 2, asked_global=64)), PolicyConfig(smaller_global_batch=True))
    assert again.plan.batch.micro_batch == 2  # no divisor to keep: any smaller size will do
    saved = shrunk.plan.as_dict()
    assert saved["global_batch"] == 32 and saved["asked_global"] == 64
    assert plan.resumed(saved) == shrunk.plan  # a restarted supervisor continues at the shrunk plan
    doc = {"state": "running", "supervisor_alive": True, "reason": "", "attempt": 2, "micro_batch": 16,
           "grad_accum": 1, "world_size": 2, "global_batch": 32, "asked_global_batch": 64, "worker_pid": None,
           "progress": None, "failures": []}
    assert "batch:      micro 16 × accum 1 × world 2 = 32 (asked 64)" in format_status(doc)


def test_grad_accum_total_is_the_accumulation_of_all_ranks() -> None:
    config = build_config({"micro_batch": "4", "global_batch": "16"},
                          ["torchrun", "--nproc_per_node=2", "train.py", "--batch_size={micro_batch}",
                           "--gradient_accumulation_steps={grad_accum_total}"])
    values = placeholder_values(config, Plan(config.initial_plan), 1, None)
    assert (values["grad_accum"], values["grad_accum_total"], values["world_size"]) == (2, 4, 2)


def test_a_script_that_divides_by_the_world_size_is_warned_of_the_per_rank_value(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(NANOGPT_LINES)
    (tmp_path / "plain.py").write_text("gradient_accumulation_steps = 4\n")
    per_rank = ["torchrun", "--standalone", "--nproc_per_node=2", "train.py", "config/train_gpt2.py",
                "--batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}"]
    from oomguard.supervisor.distributed.launcher import program

    line = total_warning(per_rank, program(per_rank), tmp_path, 2, 2, 4)
    assert line == ("train.py divides --gradient_accumulation_steps by the world size (as nanoGPT does) but is given "
                    "the per-rank {grad_accum}: each rank would accumulate 1, not 2, and train at a global batch of "
                    "8, not 16; pass --gradient_accumulation_steps={grad_accum_total}")
    total = [w.replace("{grad_accum}", "{grad_accum_total}") for w in per_rank]
    assert total_warning(total, program(total), tmp_path, 2, 2, 4) is None
    assert total_warning(per_rank, program(per_rank), tmp_path, 2, 1, 4) is None  # one rank: total = per rank
    plain = [w.replace("train.py", "plain.py") for w in per_rank]
    assert total_warning(plain, program(plain), tmp_path, 2, 2, 4) is None


def test_the_start_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text(NANOGPT_LINES)
    monkeypatch.chdir(tmp_path)
    config = build_config({"micro_batch": "4", "global_batch": "16"},
                          ["torchrun", "--nproc_per_node=2", "train.py", "--batch_size={micro_batch}",
                           "--gradient_accumulation_steps={grad_accum}"])
    assert [line.split(":")[0] for line in notices(config)] == ["train.py divides --gradient_accumulation_steps by "
                                                                "the world size (as nanoGPT does) but is given the "
                                                                "per-rank {grad_accum}"]
    none = notices(build_config({"micro_batch": "32", "global_batch": "32"}, NO_ACCUM))
    assert none == ["the command passes {micro_batch} but no {grad_accum}: the script cannot accumulate, so its "
                    "global batch is micro × world = 32, and a halving will shrink it; oomguard will not halve it "
                    "without --allow-smaller-global-batch (or put {grad_accum} where the script takes its "
                    "accumulation)"]
    assert notices(build_config({"micro_batch": "4", "global_batch": "16"},
                                ["python", "t.py", "--bs", "{micro_batch}", "--ga", "{grad_accum}"])) == []


# --edit FILE:KEY=VALUE: per-attempt copies with keys set; the user's file is never written.


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
