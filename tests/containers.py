"""Build and run docker/Dockerfile for real, with Debian's podman (importable as ``containers``).

No image registry is reachable from CI, so the image's base (``--build-arg BASE_IMAGE=``) is made here:
``mmdebstrap`` (debootstrap's faster successor) of this machine's own Debian release with python3 and
python3-venv, imported with ``podman import``. It is cached in ``CACHE`` (the tarball) and in podman's
storage (the image), both named by a hash of the recipe, so only the first run on a machine makes it.

What this machine needed, and why each flag is there:

* ``--runtime runc``: Debian's crun refuses the hybrid cgroup layout (v1 controllers plus a v2 mount);
  runc runs there and on a pure v1 or v2 host alike.
* ``--cgroup-manager cgroupfs``: systemd is not PID 1 on a CI machine, so podman cannot ask it for
  cgroups; cgroupfs works with or without systemd.
* ``--ulimit nofile=…,nproc=…`` within this process's own limits and podman's: its defaults (1048576 for
  both) are above the hard limits here, and runc then fails with ``error setting rlimit type 7 (or 6):
  operation not permitted``; ``--ulimit host`` fails the same way.
* ``--format docker`` at build: an OCI image config has no HEALTHCHECK, and buildah would drop it.
* ``--network host`` at build only (``pip install`` reaches PyPI without a bridge or NAT being set up);
  the test's containers run with ``--network none``: a loopback of their own, so port 8765 inside never
  meets a port on the host or a parallel test, and the HEALTHCHECK's ``127.0.0.1:8765`` is the container's.
* The base carries this machine's CA bundle and a ``/etc/pip.conf`` naming it, as the host's pip does:
  where HTTPS leaves through an inspecting proxy, pip in the build trusts what the host trusts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CACHE = Path(os.environ.get("OOMGUARD_CONTAINER_CACHE", "/var/cache/oomguard-test"))
PACKAGES = ("python3", "python3-venv", "ca-certificates")
BASE_REPOSITORY = "localhost/oomguard-test-base"
IMAGE = "localhost/oomguard-test:latest"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
GLOBAL = ["--runtime", "runc", "--cgroup-manager", "cgroupfs"]
# runc runs below podman, which holds RLIMIT_NPROC at 32768 (`podman build --help` shows that default) and
# asks for RLIMIT_NOFILE 1048576: a container may not be given more than either.
PODMAN_NPROC = 32768
PODMAN_NOFILE = 1048576


def unavailable() -> str | None:
    """Why this machine cannot build and run the image, or None when it can (as far as can be seen)."""
    if platform.system() != "Linux":
        return "containers need Linux"
    if os.geteuid() != 0:
        return "podman and mmdebstrap need root here (rootless podman needs subuid ranges set up)"
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # runc lives there
    missing = [tool for tool in ("podman", "runc", "mmdebstrap") if shutil.which(tool, path=path) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install podman runc mmdebstrap; scripts/test.sh does)"
    if debian_codename() is None:
        return "not a Debian machine: no release to make a base from"
    info = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout=60)
    if info.returncode != 0:
        return f"podman cannot start here: {_last_line(info.stderr)}"
    return None


def podman(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *GLOBAL, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} … failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


def ulimits() -> list[str]:
    """File and process limits runc may set: no higher than this process's own, nor than podman's own."""
    nofile = _bounded(resource.RLIMIT_NOFILE, PODMAN_NOFILE)
    nproc = _bounded(resource.RLIMIT_NPROC, PODMAN_NPROC)
    return ["--ulimit", "nofile={}:{}".format(*nofile), "--ulimit", "nproc={}:{}".format(*nproc)]


def _bounded(limit: int, cap: int) -> tuple[int, int]:
    soft, hard = resource.getrlimit(limit)
    hard = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    return (hard if soft == resource.RLIM_INFINITY else min(soft, hard)), hard


def debian_codename() -> str | None:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    if fields.get("ID", "").strip('"') != "debian":
        return None
    return fields.get("VERSION_CODENAME", "").strip('"') or None


def debian_mirror(codename: str) -> str:
    """The Debian archive apt already uses here (a machine may only reach its own mirror or proxy)."""
    sources = Path("/etc/apt/sources.list.d")
    for path in sorted(sources.glob("*.sources")) if sources.is_dir() else []:
        for stanza in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if codename in fields.get("Suites", "").split() and "main" in fields.get("Components", "").split():
                return fields.get("URIs", DEFAULT_MIRROR).split()[0]
    listing = Path("/etc/apt/sources.list")
    text = listing.read_text() if listing.exists() else ""
    found = re.search(rf"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+{re.escape(codename)}\s", text, re.M)
    return found.group(1) if found else DEFAULT_MIRROR


def base_image() -> str:
    """The local Debian base, taken from podman's storage or the cached tarball, else made (call it under
    ``locked()``: parallel test runs share the cache)."""
    codename = debian_codename()
    assert codename is not None
    mirror = debian_mirror(codename)
    recipe = {"tool": "mmdebstrap", "suite": codename, "mirror": mirror, "variant": "minbase", "packages": PACKAGES,
              "ca": hashlib.sha256(HOST_CA.read_bytes()).hexdigest() if HOST_CA.exists() else None}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    ref = f"{BASE_REPOSITORY}:{codename}-{key}"
    if podman("image", "exists", ref).returncode == 0:
        return ref
    tarball = CACHE / f"debian-{codename}-{key}.tar"
    if not tarball.exists():
        _bootstrap(codename, mirror, tarball)
    podman("import", "--quiet", "--change", 'CMD ["python3"]', str(tarball), ref, timeout=300, check=True)
    return ref


def cannot_run(image: str) -> str | None:
    """Why no container starts here (a kernel or cgroup setup runc refuses), or None when one does."""
    probe = podman("run", "--rm", "--network", "none", *ulimits(), image, "python3", "-c", "pass", timeout=120)
    return None if probe.returncode == 0 else f"podman cannot run a container here: {_last_line(probe.stderr)}"


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One test run at a time makes the base, builds and runs (another engineer's run waits its turn).
    Not reentrant: flock on a second open of the file would wait for the first."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _bootstrap(codename: str, mirror: str, tarball: Path) -> None:
    """A minimal Debian as a tarball. mmdebstrap, not debootstrap: it downloads in parallel through apt
    and writes the tarball itself, in about half the time (on a busy 2-core machine 144 s against 249 s,
    42 against 79 CPU seconds). The hooks give the base the host's trust (see the module's docstring)."""
    partial = tarball.with_name(tarball.name + ".partial")
    trust = [f"--customize-hook=copy-in {HOST_CA} /etc/ssl/certs",
             '--customize-hook=printf "[global]\\ncert = /etc/ssl/certs/ca-certificates.crt\\n" > "$1/etc/pip.conf"']
    done = subprocess.run(
        ["mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", f"--include={','.join(PACKAGES)}",
         "--aptopt=APT::Install-Recommends \"false\"", *(trust if HOST_CA.exists() else []),
         codename, str(partial), mirror], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise AssertionError(f"mmdebstrap {codename} {mirror} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    partial.replace(tarball)  # a run cut short leaves no half tarball under the final name


def build(root: Path, base: str) -> tuple[str, float]:
    """docker/Dockerfile built on ``base``: (image id, seconds). Layers are cached between runs."""
    before = podman("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        iid = Path(tmp) / "iid"
        podman("build", "--format", "docker", "--network", "host", *ulimits(), "--build-arg", f"BASE_IMAGE={base}",
               "--iidfile", str(iid), "-f", str(root / "docker" / "Dockerfile"), "-t", IMAGE, str(root),
               timeout=900, check=True)
        image = iid.read_text().strip().removeprefix("sha256:")
    if before and before != image:  # the last build's image (and its own layers) would otherwise pile up
        podman("rmi", before)
    return image, time.monotonic() - started


# systemd as PID 1 over the same base (tests/e2e/test_systemd_pid1.py). Only systemd and oomguard's dependencies are
# in the image; the checkout's oomguard/ is mounted read-only at run time through a .pth file, so a change to
# the code needs no rebuild and the image is made once per machine (its tag is a hash of the recipe).
SYSTEMD_REPOSITORY = "localhost/oomguard-test-systemd"
SYSTEMD_SOURCE = "/opt/oomguard/src"  # mount the checkout's oomguard/ at SYSTEMD_SOURCE/oomguard
SYSTEMD_OOMGUARD = "/opt/oomguard/venv/bin/oomguard"
SYSTEMD_CONTAINERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends systemd \\
    && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY requirements.txt /opt/oomguard/requirements.txt
RUN python3 -m venv /opt/oomguard/venv \\
    && /opt/oomguard/venv/bin/pip install -q --no-cache-dir -r /opt/oomguard/requirements.txt \\
    && site="$(/opt/oomguard/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \\
    && echo /opt/oomguard/src > "$site/oomguard-src.pth"
COPY oomguard /opt/oomguard/venv/bin/oomguard
STOPSIGNAL SIGRTMIN+3
CMD ["/lib/systemd/systemd"]
"""
# The console script pip would write for the package's [project.scripts] entry.
SYSTEMD_LAUNCHER = ("#!/opt/oomguard/venv/bin/python\n"
                    "import sys\nfrom oomguard.supervisor.cli import main\nsys.exit(main())\n")


def systemd_image(root: Path, base: str) -> tuple[str, float]:
    """Debian with systemd and oomguard's dependencies on ``base``: (reference, seconds spent building; 0
    when podman already had it). Call it under ``locked()``."""
    requirements = "\n".join(_dependencies(root / "pyproject.toml")) + "\n"
    recipe = "\0".join([base, SYSTEMD_CONTAINERFILE, SYSTEMD_LAUNCHER, requirements])
    key = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    ref = f"{SYSTEMD_REPOSITORY}:{key}"
    if podman("image", "exists", ref).returncode == 0:
        return ref, 0.0
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as context:
        (Path(context) / "Containerfile").write_text(SYSTEMD_CONTAINERFILE)
        (Path(context) / "requirements.txt").write_text(requirements)
        (Path(context) / "oomguard").write_text(SYSTEMD_LAUNCHER)
        (Path(context) / "oomguard").chmod(0o755)  # COPY keeps the mode
        podman("build", "--format", "docker", "--network", "host", *ulimits(), "--build-arg", f"BASE_IMAGE={base}",
               "-t", ref, context, timeout=900, check=True)
    for old in podman("images", "--format", "{{.Repository}}:{{.Tag}}", SYSTEMD_REPOSITORY).stdout.split():
        if old != ref:  # an earlier recipe's image
            podman("rmi", old)
    return ref, time.monotonic() - started


def _dependencies(pyproject: Path) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"
