"""The restart path of a training script under ``oomguard run``, cold against a spare interpreter.

Three scripts train the small GPT of peerkit/workload.py with AdamW: a plain torch script
(bench/peerkit/train_plain.py, argparse), a Hugging Face ``Trainer`` script
(peerkit/restart_hf.py) and a Lightning script (peerkit/restart_lightning.py), each taking the
micro-batch and accumulation oomguard passes. Each is asked for a global batch of 64 at
micro-batch 64 under a real memory cap (``PEERS_BUDGET_MB``, RLIMIT_AS at the first forward): it
OOMs at 64 and 32 and trains at 16, so each run has two restarts. The script writes its own
records (process start before its imports, imports done, model built, first batch, each optimizer
step, the uncaught OOM and its atexit), so each restart
splits into: the OOM to the script's atexit; its exit to the next script's first line (the
interpreter's teardown, oomguard noticing and deciding, the spawn and the interpreter start, or
the handover to a spare); the next script's imports; model build; data; first optimizer step.

Runs with ``--no-spare`` (cold) and with the spare alternate, the order rotated each round, so
both see the same load; medians with the min-max spread over every restart of each mode, then each
restart apart (``by_restart``: the first follows a cold attempt, the second an attempt that itself
started from a spare and OOMed within seconds). ``bench/restart_ab.py`` runs another checkout's spare
beside this one's, interleaved, to measure a change.

    python bench/restart_path.py --rounds 3            # the plain script: about 4 minutes on 2 loaded cores
    python bench/restart_path.py --rounds 3 --scripts plain hf lightning --json out.json
    python bench/restart_path.py --imports 3          # what a spare takes off an HF Trainer and a Lightning script

``--imports N``: for examples/train_hf_trainer.py and examples/train_lightning_cli.py (and the plain
script), the seconds a fresh interpreter takes to start and import what each script imports (the
modules the spare pre-imports, found the way it finds them), N interleaved rounds: the part of their
restart path a spare removes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "bench" / "peerkit"
SEGMENTS = ("oom to atexit", "exit to next script start", "imports", "model build", "data", "first step")
MODES = ("cold", "spare")
SCRIPTS = {  # name -> (script, its flags for the micro-batch, the accumulation and the steps)
    "plain": ("train_plain.py", "--batch-size", "--gradient-accumulation-steps", "--steps"),
    "hf": ("restart_hf.py", "--per_device_train_batch_size", "--gradient_accumulation_steps", "--max_steps"),
    "lightning": ("restart_lightning.py", "--batch-size", "--accumulate-grad-batches", "--max-steps"),
}
TITLES = {"plain": "plain torch", "hf": "HF Trainer", "lightning": "Lightning"}


def script_command(script: str, steps: int) -> list[str]:
    """The worker command oomguard runs for one of the scripts, with its own flags' names."""
    path, micro, accum, steps_flag = SCRIPTS[script]
    return [sys.executable, str(KIT / path), micro, "{micro_batch}", accum, "{grad_accum}", steps_flag, str(steps)]


def one_run(work: Path, mode: str, steps: int, budget_mb: int, device: str = "cpu",
            script: str = "plain") -> list[dict[str, float]]:
    """One ``oomguard run`` of the script; the split of each of its restarts."""
    run = work / f"{mode}-{time.monotonic_ns()}"
    records = run / "records.jsonl"
    run.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OOMGUARD_", "PEERS_"))}
    env.update(PYTHONPATH=str(ROOT), PEERS_RECORDS=str(records), PEERS_BUDGET_MB=str(budget_mb),
               PEERS_DEVICE=device, OOMGUARD_CACHE_DIR=str(run / "fitstore"))  # an empty fit store: the OOMs happen
    cmd = [sys.executable, "-m", "oomguard", "run", "--run-dir", str(run / "run"), "--no-web", "--backoff", "0",
           "--global-batch", "64", "--micro-batch", "64", *(["--no-spare"] if mode == "cold" else []), "--",
           *script_command(script, steps)]
    proc = subprocess.run(cmd, env=env, cwd=run, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"oomguard run of {script} ({mode}) exited {proc.returncode}: {proc.stderr[-1500:]}")
    return split(records)


def split(records: Path) -> list[dict[str, float]]:
    by_pid: dict[int, dict[str, float]] = {}
    for line in records.read_text().splitlines():
        rec = json.loads(line)
        by_pid.setdefault(rec["pid"], {}).setdefault(rec["ev"], rec["t"])
    procs = sorted(by_pid.values(), key=lambda p: p.get("proc", 0.0))
    out = []
    for n, (failed, nxt) in enumerate(zip(procs, procs[1:], strict=False), start=1):
        end = nxt.get("opt", nxt.get("exception"))
        if "exception" not in failed or end is None or any(k not in nxt for k in ("proc", "imported", "model", "data")):
            continue
        points = [failed["exception"], failed.get("exit", failed["exception"]), nxt["proc"], nxt["imported"],
                  nxt["model"], nxt["data"], end]
        row = {seg: b - a for seg, a, b in zip(SEGMENTS, points[:-1], points[1:], strict=True)}
        row["total"] = end - failed["exception"]
        row["restart"] = n  # the first restart follows a cold attempt; later ones an attempt from a spare
        out.append(row)
    return out


def summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    return {key: {"median": round(statistics.median(r[key] for r in rows), 3),
                  "min": round(min(r[key] for r in rows), 3), "max": round(max(r[key] for r in rows), 3)}
            for key in (*SEGMENTS, "total")}


def markdown(result: dict[str, Any]) -> str:
    """One table: a line per script and mode, each segment's median over every restart."""
    head = "| script | mode | restarts | " + " | ".join(SEGMENTS) + " | total (min–max) |"
    lines = [head, "|" + "---|" * (len(SEGMENTS) + 4)]
    for script, by_mode in result["scripts"].items():
        for mode in MODES:
            s = by_mode.get(mode)
            if s is None:
                continue
            cells = " | ".join(f"{s[seg]['median']:.2f}" for seg in SEGMENTS)
            t = s["total"]
            lines.append(f"| {TITLES[script]} | {mode} | {by_mode['restarts'][mode]} | {cells} | "
                         f"**{t['median']:.2f}** ({t['min']:.2f}–{t['max']:.2f}) |")
    return "\n".join(lines)


IMPORT_SCRIPTS = {"plain torch": KIT / "train_plain.py", "HF Trainer": ROOT / "examples" / "train_hf_trainer.py",
                  "Lightning": ROOT / "examples" / "train_lightning_cli.py"}


def import_times(rounds: int) -> dict[str, dict[str, Any]]:
    """Interpreter start plus the script's third-party imports, cold, each script in turn per round."""
    from oomguard.supervisor.run.spare import heavy_imports

    code = ("import importlib, sys\nfor item in sys.argv[1:]:\n    module, _, names = item.partition(':')\n"
            "    try:\n        m = importlib.import_module(module)\n"
            "        [getattr(m, n, None) for n in names.split(',') if n]\n"
            "    except Exception:\n        pass\n")
    times: dict[str, list[float]] = {name: [] for name in IMPORT_SCRIPTS}
    for r in range(rounds):
        names = list(IMPORT_SCRIPTS)
        for name in names[r % len(names):] + names[:r % len(names)]:
            script = IMPORT_SCRIPTS[name]
            items = [i for i in heavy_imports(script) if i.split(".")[0].split(":")[0] not in sys.stdlib_module_names]
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code, *items], check=True, cwd=script.parent, capture_output=True)
            times[name].append(time.perf_counter() - start)
            print(f"round {r + 1} {name}: {times[name][-1]:.2f} s ({', '.join(items)})", flush=True)
    return {name: {"median": round(statistics.median(t), 2), "min": round(min(t), 2), "max": round(max(t), 2)}
            for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps each run trains")
    p.add_argument("--budget-mb", type=int, default=180, help="memory each process may add after its first forward")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: untested here (no GPU was lent)")
    p.add_argument("--imports", type=int, default=0, metavar="N", help="time the imports of three scripts instead")
    p.add_argument("--scripts", nargs="+", choices=tuple(SCRIPTS), default=["plain"],
                   help="which scripts' restart paths to split (plain torch, HF Trainer, Lightning)")
    args = p.parse_args()
    if args.imports:
        print(json.dumps(import_times(args.imports)))
        return
    rows = {script: {m: list[dict[str, float]]() for m in MODES} for script in args.scripts}
    load, began = os.getloadavg()[0], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for script in args.scripts:  # cold and spare back to back, their order alternating by round
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    got = one_run(Path(tmp), mode, args.steps, args.budget_mb, args.device, script)
                    rows[script][mode] += got
                    print(f"round {r + 1} {script} {mode}: " + ", ".join(f"{g['total']:.2f} s" for g in got),
                          flush=True)
    result: dict[str, Any] = {"scripts": {script: by_script(rows[script]) for script in args.scripts}}
    result["load"] = [round(load, 1), round(os.getloadavg()[0], 1)]
    result["cpus"] = os.cpu_count()
    result["elapsed_s"] = round(time.monotonic() - began, 1)
    print(markdown(result))
    print(json.dumps({k: result[k] for k in ("load", "cpus", "elapsed_s")}
                     | {s: r["spare_over_cold"] for s, r in result["scripts"].items()}))
    print(json.dumps({s: r["by_restart"] for s, r in result["scripts"].items()}))
    if args.json:
        args.json.write_text(json.dumps({**result, "rows": rows}, indent=1))


def by_script(rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each mode's summary, how many restarts it had and spare over cold (the medians' ratio)."""
    out: dict[str, Any] = {m: summary(rows[m]) for m in MODES if rows[m]}
    out["restarts"] = {m: len(rows[m]) for m in MODES}
    both = all(m in out for m in MODES)
    out["spare_over_cold"] = (round(out["spare"]["total"]["median"] / out["cold"]["total"]["median"], 3)
                              if both else None)
    out["by_restart"] = by_restart(rows) if both else {}
    return out


def by_restart(rows: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per restart of a run (the first, after a cold attempt; the second, after an attempt that
    started from a spare and OOMed within seconds): each mode's median total, spare over cold, and
    the spare's median wait from the exit to the next script's start."""
    out = {}
    for n in sorted({int(r["restart"]) for m in MODES for r in rows[m]}):
        cold = [r["total"] for r in rows["cold"] if r["restart"] == n]
        spare = [r for r in rows["spare"] if r["restart"] == n]
        if cold and spare:
            median = statistics.median(r["total"] for r in spare)
            out[str(n)] = {"cold": round(statistics.median(cold), 2), "spare": round(median, 2),
                           "spare_over_cold": round(median / statistics.median(cold), 3),
                           "spare_exit_to_start": round(statistics.median(r[SEGMENTS[1]] for r in spare), 2)}
    return out


if __name__ == "__main__":
    main()
