"""A longer kill -9 campaign than CI runs: the same test, with as many kill points as asked.

    .venv/bin/python scripts/worker_kill_campaign.py --kills 200
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=200, help="kill points for the synchronous-save run")
    args = p.parse_args()
    env = {**os.environ, "OOMGUARD_TEST_KILLS": str(args.kills)}
    test = "tests/e2e/worker/test_worker_kill.py"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    return subprocess.call(command, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
