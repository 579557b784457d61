"""Configuration: CLI and TOML merged, validated with one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from oomguard.supervisor.command import render
from oomguard.supervisor.config import build_config, parse_size
from oomguard.supervisor.lifecycle import UsageError


def test_sizes() -> None:
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size("2g") == 2 * 2**30
    assert parse_size("1048576") == 2**20
    for bad in ("5x", "", "-1G", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_toml_and_cli_merge(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('micro-batch = 16\nglobal_batch = 64\ncheckpoint = ["a/*", "b/*"]\n'
                    'memory_limit = "2G"\ncommand = ["python", "train.py"]\n')
    c = build_config({"config": str(toml), "micro_batch": "8"}, [])
    assert c.batch.micro_batch == 8 and c.batch.global_batch == 64 and c.memory.memory_limit == 2 * 2**30
    assert c.checkpoints.globs == ("a/*", "b/*") and c.command == ("python", "train.py")
    assert c.initial_plan.grad_accum == 8


@pytest.mark.parametrize("opts,command,needle", [
    ({"micro_batch": "8", "global_batch": "60"}, ["x"], "--micro-batch: 8 does not divide"),
    ({"micro_batch": "8", "global_batch": "63", "world_size": "2"}, ["x"], "not divisible by --world-size"),
    ({"micro_batch": "64", "global_batch": "64", "world_size": "2"}, ["x"], "above the per-process batch 32"),
    ({"micro_batch": "8"}, ["x"], "exactly one of --global-batch and --grad-accum"),
    ({"micro_batch": "8", "grad_accum": "2"}, [], "no training command"),
    ({"micro_batch": "8", "grad_accum": "2"}, ["python", "{nope}"], "unknown placeholder {nope}"),
    ({"micro_batch": "8", "grad_accum": "x"}, ["x"], "--grad-accum: bad value"),
    ({"micro_batch": "8", "grad_accum": "2", "checkpoint_signal": "SIGFOO"}, ["x"], "--checkpoint-signal"),
    ({"micro_batch": "8", "grad_accum": "2", "grow": True, "nnodes": "2", "node_rank": "0",
      "rdzv_endpoint": "node0:29400"}, ["python", "train.py"], "--grow: cannot be used with --nnodes 2"),
])
def test_bad_values_name_the_option(opts: dict[str, str], command: list[str], needle: str) -> None:
    with pytest.raises(UsageError) as err:
        build_config(opts, command)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_toml_key(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("micro_batch = 8\ngrad_accum = 2\nbatchsize = 3\n")
    with pytest.raises(UsageError, match="batchsize: unknown key"):
        build_config({"config": str(toml)}, ["x"])


def test_placeholders_render_and_escape() -> None:
    values = {"micro_batch": 4, "checkpoint": "/c/checkpoint-8", "checkpoint_step": 8}
    assert render("--bs={micro_batch}", values) == "--bs=4"
    assert render("{{literal}}", values) == "{literal}"
    assert render("--resume_from_step={checkpoint_step}", values) == "--resume_from_step=8"


def test_every_subcommand_has_working_help() -> None:
    from support import oomguard

    top = oomguard("--help")
    assert top.returncode == 0
    for name in ("run", "status", "report", "logs", "service", "doctor", "checkpoint", "restart", "stop"):
        out = oomguard(name, "--help")
        assert out.returncode == 0 and "usage: oomguard" in out.stdout, (name, out.stderr)


def test_sections_keep_the_flat_names_and_read_the_command_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36.4: the options live in frozen sections, but the TOML keys, argparse's names and the
    journal's to_json() stay flat; the training command is parsed once per config, not per access."""
    from oomguard.supervisor import config as config_module

    c = build_config({"micro_batch": "8", "grad_accum": "2", "checkpoints": ["out/*"], "checkpoint_signal": "usr2",
                      "web": False, "notify": ["json://localhost/x"]},
                     ["torchrun", "--nproc-per-node", "2", "train.py", "--ga", "{grad_accum}"])
    assert c.batch.micro_batch == 8 and c.checkpoints.globs == ("out/*",) and c.checkpoints.signal == "SIGUSR2"
    assert not c.web.enabled and c.notify.targets == ("json://localhost/x",)
    assert c.world_size == 2 and c.distributed.world_size == 1  # torchrun's shape; the option as given
    data = c.to_json()
    assert {o.name for o in config_module.options()} | {"command", "run_dir"} == set(data)
    assert data["checkpoints"] == ("out/*",) and data["web"] is False and data["world_size"] == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.batch.micro_batch = 4  # type: ignore[misc]
    calls: list[object] = []
    real = config_module.shape_of
    monkeypatch.setattr(config_module, "shape_of", lambda *a: calls.append(a) or real(*a))
    fresh = config_module.RunConfig.of(**{k: v for k, v in data.items() if k != "world_size"} | {"run_dir": Path("r")})
    for _ in range(3):
        assert fresh.dist_shape is not None and fresh.accumulation is c.accumulation and fresh.may_shrink
    assert len(calls) == 1 and fresh.to_json()["micro_batch"] == 8
