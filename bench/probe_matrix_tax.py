"""The probe's step-time tax in whole processes: the matrix's cases (tests/matrix/tiny.py) run plain
and probed, alternating, for ``--rounds`` rounds; per run the median step time after ``--warmup``
steps (the main thread's CPU time, tests/matrix/matrix_report.py), then per case the median over
rounds of plain and probed and their ratio. docs/probe.md's case table has the figures.

    .venv/bin/python bench/probe_matrix_tax.py --cases eager compile --rounds 5 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from probing_matrix import MATRIX_DIR, run_once, steady


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=["eager", "compile"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            medians: dict[bool, list[float]] = {False: [], True: []}
            for index in range(args.rounds):
                for probed in (False, True):
                    argv = [str(MATRIX_DIR / "tiny.py"), "--case", case, "--steps", str(args.steps)]
                    run = run_once(Path(tmp) / f"{case}-{index}-{probed}", argv, probed)
                    medians[probed].append(steady(run.times, args.warmup))
            plain, probed_ = statistics.median(medians[False]), statistics.median(medians[True])
            print(f"{case}: plain {plain * 1e3:.2f} ms, probed {probed_ * 1e3:.2f} ms, ratio {probed_ / plain:.3f} "
                  f"(medians over {args.rounds} rounds of {args.steps} steps after {args.warmup})", flush=True)


if __name__ == "__main__":
    main()
