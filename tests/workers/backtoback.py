"""Back-to-back OOMs for the spare pool's test (tests/unit/supervisor/run/test_spare.py): the second restart must find a
spare that has already imported.

    python backtoback.py --mb MICRO --ga ACCUM --wait-for FILE

It imports ``heavymod`` (the test's fake third-party module, which a spare pre-imports). At micro-batch
8 (the cold first attempt) it waits until FILE exists (the reserve spare's ready record, which
oomguard writes once the reserve has imported; up to 60 s, then it goes on, and the test fails on what
the journal says), then raises a CUDA OOM; at 4 (an attempt from a spare) it raises one at once, so
that attempt lives well under a second; at 2 it trains. Each attempt prints what it was given and
whether its imports were already done.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

prewarmed = "heavymod" in sys.modules
import heavymod  # noqa: E402,F401  (after the check: was it imported before the script ran?)

WAIT_S = 60.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, required=True)
    p.add_argument("--ga", type=int, required=True)
    p.add_argument("--wait-for", type=Path, required=True)
    args = p.parse_args()
    print(f"attempt micro={args.mb} accum={args.ga} prewarmed={prewarmed}", flush=True)
    if args.mb == 8:
        deadline = time.monotonic() + WAIT_S
        while not args.wait_for.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"reserve ready={args.wait_for.exists()}", flush=True)
    if args.mb > 2:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    print(f"trained micro={args.mb} accum={args.ga}", flush=True)


if __name__ == "__main__":
    main()
