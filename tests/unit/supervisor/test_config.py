"""Configuration: CLI and TOML merged, validated with one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.supervisor.command import render
from oomguard.supervisor.config import build_config, parse_size
from oomguard.supervisor.errors import UsageError


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
    assert c.micro_batch == 8 and c.global_batch == 64 and c.memory_limit == 2 * 2**30
    assert c.checkpoints == ("a/*", "b/*") and c.command == ("python", "train.py")
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
