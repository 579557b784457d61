#!/usr/bin/env bash
# The whole check, from a clean clone: install, lint, type-check, test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
# The dashboard is tested in Debian's chromium driven by Playwright (never a downloaded browser).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing Debian chromium for the dashboard tests" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "test.sh: no chromium and not root: the browser tests will be skipped" >&2
  fi
fi
# The multi-node sbatch example is checked with Debian's shellcheck (tests/e2e/test_deploy.py).
if ! command -v shellcheck >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null 2>&1 || true
fi
# The image is built and run for real (tests/e2e/test_docker.py) with Debian's podman and runc, on a Debian
# base that mmdebstrap makes here, since no image registry is reachable from CI. Not fatal: without them
# those tests say why and skip.
if ! { command -v podman && command -v runc && command -v mmdebstrap; } >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing Debian podman, runc and mmdebstrap for the container tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap; } \
      >/dev/null 2>&1 || echo "test.sh: could not install podman, runc, mmdebstrap: the container tests will be skipped" >&2
  else
    echo "test.sh: no podman, runc or mmdebstrap and not root: the container tests will be skipped" >&2
  fi
fi
# docs/deploy/oomguard.sbatch runs under a real Slurm (tests/e2e/test_slurm.py): Debian's slurmctld, slurmd and
# munge, started by the test itself (no service is enabled); acl lets the jobs' unprivileged user reach a Python
# under /root. Not fatal: without them those tests say why and skip.
if ! { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged && command -v setfacl; } \
    >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing Debian slurmctld, slurmd, slurm-client, munge and acl for the Slurm tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge acl; } >/dev/null 2>&1 \
      || echo "test.sh: could not install Slurm and munge: the Slurm tests will be skipped" >&2
  else
    echo "test.sh: no Slurm and not root: the Slurm tests will be skipped" >&2
  fi
fi
.venv/bin/ruff check oomguard tests bench examples scripts
.venv/bin/mypy
.venv/bin/lint-imports --no-cache >/dev/null || .venv/bin/lint-imports --no-cache
# Two processes (pytest-xdist), the tests of a file on one, in the order tests/conftest.py gives (its comment
# says why); the 25 slowest tests are listed at the end, for whoever speeds the suite up next.
.venv/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 "$@"
