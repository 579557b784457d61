"""oomguard installs under one import name and lives beside supervisord in one environment.

A real fresh virtualenv: ``pip install supervisor`` (supervisord, whose import name oomguard 0.1
overwrote), then the wheel built from this tree. Both programs must work afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.slow


def _sh(*argv: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # Not from the checkout: `python -c` puts the working directory first on sys.path, and the
    # checkout's own oomguard/ folder would then stand in for the installed wheel. Nor with a PYTHONPATH
    # naming the checkout: pip would take its oomguard.egg-info (an editable install's) for oomguard
    # installed already and leave the wheel out.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False,
                          cwd=Path(argv[0]).anchor, env=env)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this tree, built from a copy so the checkout gets no build/ or egg-info."""
    src = tmp_path_factory.mktemp("src") / "oomguard"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "oomguard", src / "oomguard", ignore=shutil.ignore_patterns("__pycache__"))
    out = src.parent / "dist"
    built = _sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, src)
    assert built.returncode == 0, built.stderr
    (found,) = out.glob("oomguard-*.whl")
    return found


def test_the_wheel_holds_only_the_oomguard_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"oomguard"}
    for expected in ("oomguard/supervisor/decide/policy.py", "oomguard/supervisor/run/launch.py",
                     "oomguard/worker/session.py", "oomguard/web/static/index.html", "oomguard/__main__.py"):
        assert expected in names


def test_beside_supervisord_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_ = env_dir / "bin"
    pip = [bin_ / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    first = _sh(*pip, "supervisor")
    if first.returncode != 0 and "No matching distribution" in first.stderr + first.stdout:
        pytest.skip(f"supervisor (supervisord) cannot be installed here: {first.stderr.strip()[-200:]}")
    assert first.returncode == 0, first.stderr
    ours = _sh(*pip, wheel)
    assert ours.returncode == 0, ours.stderr

    supervisord = _sh(bin_ / "supervisord", "--version")
    assert supervisord.returncode == 0 and supervisord.stdout.strip()[0].isdigit(), supervisord.stderr
    conf = _sh(bin_ / "echo_supervisord_conf")
    assert conf.returncode == 0 and "[supervisord]" in conf.stdout, conf.stderr
    for argv in ([bin_ / "oomguard", "--version"], [bin_ / "python", "-m", "oomguard", "--version"]):
        version = _sh(*argv)
        assert version.returncode == 0 and version.stdout.startswith("oomguard "), version.stderr
    both = _sh(bin_ / "python", "-c",
               "import oomguard, supervisor, supervisor.states as s; s.SupervisorStates;"
               "import oomguard.supervisor.run.loop, oomguard.web.app, oomguard.common.protocol;"
               "print(oomguard.__file__, supervisor.__file__)")
    assert both.returncode == 0, both.stderr
    ours_file, theirs_file = both.stdout.split()
    assert "/oomguard/" in ours_file and "/oomguard/" not in theirs_file
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    assert not (site / "worker").exists() and not (site / "web").exists()
