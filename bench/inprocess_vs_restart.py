"""What one OOM costs: absorbed inside the process vs. a crash and a restart from a checkpoint.

The demo trains at micro-batch 128 under a generous RLIMIT_AS budget that shrinks at step
``--squeeze-at`` (another tenant arrives), so that step fails in PyTorch's real allocator.

* in-process: the worker library frees the step's memory and redoes the same global batch at 64.
* restart: the same script with ``--no-inprocess`` dies; a supervisor restarts it at 64 from the
  newest checkpoint (``oomguard run`` when it is installed, else a minimal built-in restart loop
  doing the same: new process, ``OOMGUARD_MICRO_BATCH``, newest checkpoint).

The cost of the OOM = (start of the step after the failed one) - (start of the failed step)
- (one normal step), in units of a normal step; also the optimizer steps done twice.

    .venv/bin/python bench/inprocess_vs_restart.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train_worker_demo.py"


def demo_args(args: argparse.Namespace, work: Path) -> list[str]:
    return [
        "--steps", str(args.steps), "--global-batch", "128", "--grow-after", "0",
        "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(args.checkpoint_every),
        "--memory-budget-mb", "400", "--squeeze-budget-mb", "20",
        "--squeeze-at-step", str(args.squeeze_at - 1),
        "--log-samples", str(work / "steps.jsonl"),
    ]  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    env.update(extra)
    return env


def run_inprocess(args: argparse.Namespace, work: Path) -> str:
    cmd = [sys.executable, str(DEMO), *demo_args(args, work), "--micro-batch", "128"]
    subprocess.run(cmd, env=clean_env(), check=True, capture_output=True)
    return "in-process"


def run_builtin_restart(args: argparse.Namespace, work: Path) -> str:
    """The supervisor's job in its simplest form: on an OOM exit, halve and resume."""
    micro = 128
    for _ in range(5):
        cmd = [sys.executable, str(DEMO), *demo_args(args, work), "--no-inprocess"]
        proc = subprocess.run(
            cmd, env=clean_env(OOMGUARD_MICRO_BATCH=str(micro)), capture_output=True, text=True
        )
        if proc.returncode == 0:
            return "restart (built-in loop)"
        if "can't allocate memory" not in proc.stderr:
            raise RuntimeError(proc.stderr[-2000:])
        micro //= 2
    raise RuntimeError("no progress after 5 restarts")


def run_oomguard(args: argparse.Namespace, work: Path) -> str:
    run_dir = work / "run"
    worker = [sys.executable, str(DEMO), *demo_args(args, work), "--no-inprocess"]
    cmd = [
        sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--global-batch", "128",
        "--micro-batch", "128", "--checkpoint", str(work / "ckpt" / "checkpoint-*"), "--no-web",
        "--", *worker,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, cwd=ROOT, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"oomguard run exited {proc.returncode}: {proc.stderr[-1500:]}")
    return "restart (oomguard run)"


def measure(path: Path, failed_step: int) -> dict[str, float]:
    """Cost of the failed step from the per-step start times the worker logged (all attempts)."""
    log = [json.loads(line) for line in path.read_text().splitlines()]
    first = {}
    for record in log:
        first.setdefault(record["step"], record["t"])
    final = {r["step"]: r["t"] for r in log}
    normal = statistics.median(final[s + 1] - final[s] for s in range(2, failed_step - 1))
    lost = final[failed_step + 1] - first[failed_step] - normal
    redone = sum(1 for r in log if r["step"] < failed_step) - (failed_step - 1)
    return {"normal_step_s": normal, "cost_s": lost, "cost_steps": lost / normal, "steps_redone": redone}


def one(args: argparse.Namespace, mode: str) -> tuple[str, dict[str, float]]:
    work = Path(tempfile.mkdtemp(prefix="oomguard-bench-"))
    try:
        if mode == "inprocess":
            label = run_inprocess(args, work)
        elif args.supervisor == "oomguard":
            label = run_oomguard(args, work)
        else:
            label = run_builtin_restart(args, work)
        return label, measure(work / "steps.jsonl", args.squeeze_at)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--squeeze-at", type=int, default=28, help="the step that hits the OOM")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--supervisor", choices=["auto", "oomguard", "builtin"], default="auto")
    args = p.parse_args()
    if args.supervisor == "auto":
        args.supervisor = "oomguard" if _oomguard_works() else "builtin"
    results: dict[str, Any] = {}
    for mode in ("inprocess", "restart"):
        rows, label = [], mode
        for _ in range(args.repeats):
            label, row = one(args, mode)
            rows.append(row)
        results[label] = summarize(rows)
    for label, row in results.items():
        print(
            f"{label:28s} normal step {row['normal_step_s'] * 1000:6.1f} ms   OOM cost {row['cost_s']:6.2f} s"
            f" = {row['cost_steps']:6.1f} steps   optimizer steps redone {row['steps_redone']:.0f}"
        )
    print(json.dumps(results))
    return 0


def _oomguard_works() -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "oomguard", "run", "--help"], capture_output=True, cwd=ROOT
    )
    return proc.returncode == 0


if __name__ == "__main__":
    sys.exit(main())
