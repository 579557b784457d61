"""The restart path before and after a change to the spare: cold, another checkout's spare and this
tree's spare, interleaved in one run so the three see the same load.

``bench/restart_path.py`` compares cold with the spare within one run; comparing two such runs made
at different times on a shared machine compares their loads as much as the code. Here each round
runs the three arms back to back, their order rotated each round: cold (``--no-spare``, this tree),
``before`` (the spare of the checkout given, with its own ``bench/restart_path.py`` and code on
``PYTHONPATH``) and ``after`` (this tree's spare). It prints each restart's median total (the first
restart follows a cold attempt; the second an attempt that started from a spare and OOMed within
seconds), its ratio to cold, and the median "exit to next script start", where waiting for a spare
still importing shows.

    git worktree add /tmp/before <commit>      # or any copy of the older tree
    python bench/restart_ab.py /tmp/before --rounds 4 --scripts plain hf
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("cold", "before", "after")


def bench_of(tree: Path, name: str) -> ModuleType:
    """A checkout's own bench/restart_path.py: its ``one_run`` puts that checkout on PYTHONPATH."""
    spec = importlib.util.spec_from_file_location(name, tree / "bench" / "restart_path.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(rows: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    """Per script and restart: cold's median total, and each spare arm's median, ratio and wait."""
    out: dict[str, Any] = {}
    for script, by_arm in rows.items():
        for n in sorted({int(r["restart"]) for arm in ARMS for r in by_arm[arm]}):
            cold = statistics.median(r["total"] for r in by_arm["cold"] if r["restart"] == n)
            line: dict[str, Any] = {"cold": round(cold, 2)}
            for arm in ARMS[1:]:
                got = [r for r in by_arm[arm] if r["restart"] == n]
                if got:
                    total = statistics.median(r["total"] for r in got)
                    line[arm] = {"median": round(total, 2), "min": round(min(r["total"] for r in got), 2),
                                 "max": round(max(r["total"] for r in got), 2), "over_cold": round(total / cold, 3),
                                 "exit_to_start": round(statistics.median(r["exit to next script start"]
                                                                          for r in got), 2)}
            out.setdefault(script, {})[str(n)] = line
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path, help="a checkout of the code to compare with (its bench/ and oomguard/)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--scripts", nargs="+", default=["plain"], help="plain, hf, lightning")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-mb", type=int, default=180)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    mine, theirs = bench_of(ROOT, "restart_after"), bench_of(args.before.resolve(), "restart_before")
    arms = {"cold": (mine, "cold"), "before": (theirs, "spare"), "after": (mine, "spare")}
    rows: dict[str, dict[str, list[dict[str, float]]]] = {s: {a: [] for a in ARMS} for s in args.scripts}
    loads = [round(os.getloadavg()[0], 1)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for script in args.scripts:
                for arm in ARMS[r % 3:] + ARMS[:r % 3]:
                    bench, mode = arms[arm]
                    got = bench.one_run(Path(tmp), mode, args.steps, args.budget_mb, "cpu", script)
                    for n, row in enumerate(got, start=1):
                        row["restart"] = n
                    rows[script][arm] += got
                    print(f"round {r + 1} {script} {arm}: " + ", ".join(f"{g['total']:.2f} s" for g in got), flush=True)
                loads.append(round(os.getloadavg()[0], 1))
    result = {"by_restart": report(rows), "load": loads, "cpus": os.cpu_count()}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps({**result, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
