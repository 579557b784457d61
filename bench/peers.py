"""oomguard side by side with what users would pick instead: one workload, one run, one table.

Every contender trains the same small GPT-style model on random tokens (bench/peerkit/workload.py)
for ``--steps`` optimizer steps, asked for a global batch of ``--global-batch`` at that micro-batch,
under the same memory cap: at its first training forward each process caps itself at what it uses
then plus ``--budget-mb`` (RLIMIT_AS on CPU, so PyTorch's allocator really fails;
``torch.cuda.set_per_process_memory_fraction`` with ``--device cuda``). The requested micro-batch
does not fit. Each contender is used the way its own source and documentation show (each script in
bench/peerkit/ says what it follows):

- ``oomguard-run``: ``oomguard run`` around an unmodified argparse script (peerkit/train_plain.py);
  an OOM kills the process and the supervisor restarts it smaller, global batch kept.
- ``oomguard-session``: ``from oomguard import Session`` in the script (peerkit/train_session.py).
- ``hf-auto-find-batch-size``: transformers ``Trainer`` with ``auto_find_batch_size=True``.
- ``accelerate-find-executable-batch-size``: accelerate's ``find_executable_batch_size`` as in its
  official example (examples/by_feature/automatic_gradient_accumulation.py).
- ``lightning-batch-size-finder``: Lightning's ``BatchSizeFinder`` callback, then ``fit``.
- ``composer-auto-microbatch``: Composer's ``device_train_microbatch_size="auto"`` (package
  ``mosaicml``): always skipped, with its reason: every release pins an older torch, so it cannot
  be installed beside torch 2.13, and its 'auto' mode refuses any device but a GPU.

Nothing is taken from a tool's own report: every figure comes from the records the model itself
writes (each forward, each completed backward with whether the gradients were fresh, each
optimizer step), the harness's launch and exit times and, for the restart path, oomguard's journal.
First a sweep trains every micro-batch that fits (the divisors of the global batch, then a
bisection for the largest size that fits, each probe in a fresh process) so "the best that fits"
is measured.

    python bench/peers.py                       # CPU, about 4-6 minutes on 2 cores
    python bench/peers.py --device cuda --json peers.json   # untested here: no GPU was lent

Writes docs/peers.md (the table, the exact command and machine) and docs/peers.png (the chart).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "bench" / "peerkit"
DOCS = ROOT / "docs"

OURS = ("oomguard-run", "oomguard-session")
PEERS = ("hf-auto-find-batch-size", "accelerate-find-executable-batch-size", "lightning-batch-size-finder",
         "composer-auto-microbatch")
CONTENDERS = (*OURS, *PEERS)
SCRIPTS = {
    "oomguard-session": "train_session.py",
    "hf-auto-find-batch-size": "train_hf.py",
    "accelerate-find-executable-batch-size": "train_accelerate.py",
    "lightning-batch-size-finder": "train_lightning.py",
}
NEEDS = {  # contender -> the module it cannot run without (the [bench] extra installs them)
    "hf-auto-find-batch-size": "transformers",
    "accelerate-find-executable-batch-size": "accelerate",
    "lightning-batch-size-finder": "lightning",
    "composer-auto-microbatch": "composer",
}
HOW = {
    "oomguard-run": "`oomguard run --global-batch N --micro-batch N` around an unmodified argparse script "
                    "(`--batch-size {micro_batch} --gradient-accumulation-steps {grad_accum}`); an OOM ends the "
                    "process and the supervisor restarts it at a smaller divisor, the global batch kept; an empty "
                    "fit store.",
    "oomguard-session": "`Session(model, optimizer, loss_fn, SessionConfig(global_batch=N, micro_batch=N))`: the "
                        "same step retried in the process at a smaller divisor.",
    "hf-auto-find-batch-size": "`Trainer` with `TrainingArguments(per_device_train_batch_size=N, "
                               "auto_find_batch_size=True)`: the training loop restarts at `int(0.9 × size)`; "
                               "accumulation unchanged.",
    "accelerate-find-executable-batch-size": "`@find_executable_batch_size` as in accelerate's "
                                             "`examples/by_feature/automatic_gradient_accumulation.py`: accumulation "
                                             "`N // size`, size `int(0.9 × size)` after each OOM.",
    "lightning-batch-size-finder": "`Trainer(callbacks=[BatchSizeFinder()])` then `fit`: doubles from 2 with 3 "
                                   "trial steps per size until an OOM, restores the weights, fits at the last size "
                                   "that worked.",
    "composer-auto-microbatch": "`device_train_microbatch_size=\"auto\"` (mosaicml): halves the micro-batch in "
                                "the process, batch kept; GPU only.",
}
KEYS = ("contender", "requested_global", "trained_global", "micro_batch", "ooms", "settle_s", "wall_s",
        "samples_per_s", "ratio_to_best", "steps_redone")
COMPOSER_WHY = ("mosaicml (Composer) is not installed: every release pins torch<2.7.1 (0.32.1: torch>=2.6,<2.7.1), "
                "so pip cannot install it beside torch 2.13.0 without replacing torch")
# composer/trainer/trainer.py, _is_auto_microbatching: 'auto' raises ValueError on any device but a GPU.
COMPOSER_CPU = "Composer's device_train_microbatch_size='auto' only runs on a GPU (it raises ValueError on CPU)"


# ----- reading the script's own records


@dataclass
class Step:
    t: float
    samples: int  # samples whose completed backward went into this optimizer step
    micro: int  # the largest micro-batch among them
    pid: int


@dataclass
class Trace:
    """What one contender did, read from its records."""

    steps: list[Step] = field(default_factory=list)
    ooms: list[float] = field(default_factory=list)  # when each OOM'd forward (or step) started


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trace(records: Sequence[dict[str, Any]]) -> Trace:
    """Steps and OOMs from the records, in the order they were written.

    An OOM is a training forward whose backward never completed, or an optimizer step that began
    after completed backwards and never ended. The samples of a step are the completed backwards
    since the last one that found the gradients cleared (``fresh``): what an OOM'd attempt left
    behind is not counted.
    """
    out = Trace()
    samples, micro = 0, 0
    pending_fwd: float | None = None
    pending_opt: float | None = None
    since_bwd = False

    def settle_pending() -> None:
        nonlocal pending_fwd, pending_opt
        for started in (pending_fwd, pending_opt):
            if started is not None:
                out.ooms.append(started)
        pending_fwd = pending_opt = None

    for rec in records:
        ev = rec["ev"]
        if ev in ("proc", "fwd"):
            settle_pending()
        if ev == "fwd":
            pending_fwd = rec["t"]
        elif ev == "bwd":
            pending_fwd = None
            since_bwd = True
            samples, micro = (rec["n"], rec["n"]) if rec["fresh"] else (samples + rec["n"], max(micro, rec["n"]))
        elif ev == "opt_pre" and since_bwd:  # a closure-style step (Lightning) starts before its forward
            pending_opt = rec["t"]
        elif ev == "opt":
            pending_opt = None
            since_bwd = False
            out.steps.append(Step(rec["t"], samples, micro, rec["pid"]))
    settle_pending()
    return out


def summarize(name: str, tr: Trace, launch: float, end: float, requested: int, steps: int,
              best: float | None) -> dict[str, Any]:
    """The contender's row of the table (the issue's keys)."""
    if not tr.steps:
        return {"contender": name, "skipped": "no optimizer step completed (see the error above)"}
    last = tr.steps[-1]
    last_oom = max(tr.ooms) if tr.ooms else float("-inf")
    settled = [s for s in tr.steps if s.t > last_oom and s.micro == last.micro]
    rate = steady_rate(settled)
    return {
        "contender": name,
        "requested_global": requested,
        "trained_global": last.samples,
        "micro_batch": last.micro,
        "ooms": len(tr.ooms),
        "settle_s": round(settled[0].t - launch, 2) if settled else None,
        "wall_s": round(end - launch, 2),
        "samples_per_s": round(rate, 1) if rate else None,
        "ratio_to_best": round(rate / best, 3) if rate and best else None,
        "steps_redone": len(tr.steps) - steps,
    }


def steady_rate(settled: Sequence[Step]) -> float | None:
    """Samples/s once settled: each step's samples over the time since the step before, median over
    the settled steps after the first interval (warm-up: allocator pools, first-touch pages)."""
    rates = [b.samples / (b.t - a.t) for a, b in zip(settled, settled[1:], strict=False) if b.t > a.t]
    if len(rates) > 2:
        rates = rates[1:]
    return statistics.median(rates) if rates else None


# ----- running the contenders


@dataclass
class Outcome:
    name: str
    launch: float
    end: float
    returncode: int
    records: Path
    stderr: str
    work: Path


def worker_env(args: argparse.Namespace, records: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OOMGUARD_", "PEERS_"))}
    env.update(PEERS_RECORDS=str(records), PEERS_BUDGET_MB=str(args.budget_mb), PEERS_DEVICE=args.device,
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


def command_for(name: str, args: argparse.Namespace, work: Path) -> tuple[list[str], dict[str, str]]:
    g, n = str(args.global_batch), str(args.steps)
    records = work / f"{name}.jsonl"
    if name == "oomguard-run":
        ckpt = work / "run-ckpt"
        cmd = [sys.executable, "-m", "oomguard", "run", "--run-dir", str(work / "run"), "--no-web",
               "--global-batch", g, "--micro-batch", g, "--checkpoint", str(ckpt / "checkpoint-*"),
               "--resume-args", "--resume-from {checkpoint}", "--",
               # exit_stamp.py only records when the script's process is reaped (the restart split)
               sys.executable, "-I", "-S", str(KIT / "exit_stamp.py"),
               sys.executable, str(KIT / "train_plain.py"), "--batch-size", "{micro_batch}",
               "--gradient-accumulation-steps", "{grad_accum}", "--steps", n, "--output", str(ckpt)]
        # A fresh fit store: a remembered size would skip the OOMs this benchmark is about (a second
        # run of the same job does start at the size that fitted; see notes in docs/peers.md).
        return cmd, worker_env(args, records, OOMGUARD_CACHE_DIR=str(work / "fitstore"))
    cmd = [sys.executable, str(KIT / SCRIPTS[name]), "--global-batch", g, "--steps", n]
    return cmd, worker_env(args, records)


def run(name: str, cmd: list[str], env: dict[str, str], work: Path, timeout: float) -> Outcome:
    records = Path(env["PEERS_RECORDS"])
    records.unlink(missing_ok=True)
    launch = time.time()
    try:
        proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=timeout)
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, stderr = -1, f"timed out after {timeout:.0f} s: {exc.stderr!r}"[-2000:]
    return Outcome(name, launch, time.time(), code, records, stderr, work)


def skip_reason(name: str, device: str) -> str | None:
    module = NEEDS.get(name)
    installed = module is None or importlib.util.find_spec(module) is not None
    if name == "composer-auto-microbatch":
        why = [] if installed else [COMPOSER_WHY]
        why += [COMPOSER_CPU] if device == "cpu" else []
        why += [] if why else ["no Composer script yet (Composer could not be installed here to test one)"]
        return "; ".join(why)
    return None if installed else f"{module} is not installed: pip install -e '.[bench]'"


def contender_row(name: str, args: argparse.Namespace, work: Path, best: float | None) -> tuple[dict[str, Any],
                                                                                               Outcome | None]:
    why = skip_reason(name, args.device)
    if why is not None:
        print(f"{name}: skipped: {why}", flush=True)
        return {"contender": name, "skipped": why}, None
    cmd, env = command_for(name, args, work)
    out = run(name, cmd, env, work, args.timeout)
    row = summarize(name, trace(read_records(out.records)), out.launch, out.end, args.global_batch, args.steps, best)
    if out.returncode != 0:
        row = {"contender": name, "skipped": f"exited {out.returncode}: {out.stderr.strip()[-300:]}"}
    print(f"{name}: {json.dumps(row)}", flush=True)
    return row, out


def second_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``oomguard run`` once more on the same job, with the fit store the first run left: it starts
    at the size that fitted (what a user's second night costs). Fresh run directory and checkpoints."""
    shutil.rmtree(work / "run-ckpt", ignore_errors=True)
    cmd, env = command_for("oomguard-run", args, work)
    cmd[cmd.index("--run-dir") + 1] = str(work / "run-again")
    env["PEERS_RECORDS"] = str(work / "oomguard-run-again.jsonl")
    out = run("oomguard-run", cmd, env, work, args.timeout)
    row = summarize("oomguard-run", trace(read_records(out.records)), out.launch, out.end, args.global_batch,
                    args.steps, None)
    return {k: row.get(k) for k in ("trained_global", "micro_batch", "ooms", "settle_s", "wall_s")}


# ----- the sweep


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sweep(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every divisor of the global batch that fits, then a bisection up to the largest size that
    fits (each probe in a fresh process); returns the sweep row and every measured size."""
    measured: list[dict[str, Any]] = []

    def probe(sizes: list[int], steps: int) -> list[dict[str, Any]]:
        cmd = [sys.executable, str(KIT / "train_sweep.py"), "--global-batch", str(args.global_batch),
               "--steps", str(steps), "--sizes", *map(str, sizes)]
        out = run("sweep", cmd, worker_env(args, work / "sweep.jsonl"), work, args.timeout)
        found = [r for r in read_records(out.records) if r["ev"] == "sweep"]
        if out.returncode != 0 or not found:
            raise RuntimeError(f"sweep at {sizes} failed: {out.stderr.strip()[-500:]}")
        measured.extend(found)
        return found

    found = probe(divisors(args.global_batch), args.sweep_steps)
    fit = [r["micro"] for r in found if r["fits"]]
    failed = [r["micro"] for r in found if not r["fits"]]
    low, high = (max(fit) if fit else 0), (min(failed) if failed else None)
    while args.bisect and high is not None and high - low > 1:  # the largest size that fits, divisor or not
        mid = (low + high) // 2
        if probe([mid], args.sweep_steps)[0]["fits"]:
            low = mid
        else:
            high = mid
    fits = sorted((r for r in measured if r["fits"]), key=lambda r: r["micro"])
    if not fits:
        return {"contender": "sweep", "skipped": "no micro-batch fits under the budget"}, measured
    best = max(fits, key=lambda r: r["samples_per_s"])
    row = {"contender": "sweep", "micro_batch": best["micro"], "samples_per_s": round(best["samples_per_s"], 1),
           "largest_fitting": low if args.bisect else max(r["micro"] for r in fits),
           "smallest_failing": high,
           "fits": {str(r["micro"]): round(r["samples_per_s"], 1) for r in fits}}
    print(f"sweep: {json.dumps(row)}", flush=True)
    return row, measured


# ----- the restart path: where the time between an OOM and the next first step goes


SEGMENTS = ("oom to atexit", "teardown", "notice and decide", "spawn", "interpreter start", "imports",
            "model build", "data", "first step")  # "first step": or, when the size fails too, its OOM


def restart_split(records: Sequence[dict[str, Any]], run_dir: Path) -> list[dict[str, Any]]:
    """For each restart: seconds from the OOM (the script's excepthook record) to its atexit
    record, to the process reaped (exit_stamp.py: the interpreter's teardown), to the supervisor's
    decision (journal: attempt ended), to the next worker's spawn (journal: attempt started), to
    the new interpreter's first line, imports done, model built (checkpoint loaded), first batch
    drawn and first optimizer step done (the script's records)."""
    journal = run_dir / "journal.sqlite"
    if not journal.exists():
        return []
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        attempts = db.execute("SELECT attempt, started, ended FROM attempts ORDER BY attempt").fetchall()
    finally:
        db.close()
    by_pid: dict[int, dict[str, float]] = {}
    for rec in records:
        if rec["ev"] in ("proc", "imported", "model", "data", "exception", "exit", "reaped", "opt"):
            by_pid.setdefault(rec["pid"], {}).setdefault(rec["ev"], rec["t"])
    procs = sorted(by_pid.values(), key=lambda p: p.get("proc", 0.0))
    splits = []
    for i, (failed, following) in enumerate(zip(procs, procs[1:], strict=False)):
        end = following.get("opt", following.get("exception"))  # an attempt that OOMs again ends there
        needed = ("proc", "imported", "model", "data")
        if i + 1 >= len(attempts) or "exception" not in failed or end is None or any(k not in following
                                                                                      for k in needed):
            continue
        ended, started = attempts[i][2], attempts[i + 1][1]
        exited = failed.get("exit", failed["exception"])
        points = [failed["exception"], exited, failed.get("reaped", exited), ended, started,
                  *(following[k] for k in needed), end]
        split: dict[str, Any] = {seg: round(b - a, 3)
                                 for seg, a, b in zip(SEGMENTS, points[:-1], points[1:], strict=True)}
        split["then"] = "step" if "opt" in following else "oom"
        splits.append(split)
    return splits


# ----- output


def markdown(rows: Sequence[dict[str, Any]], sweep_row: dict[str, Any], splits: Sequence[dict[str, Any]],
             argv: Sequence[str], machine: str, elapsed: float) -> str:
    lines = [
        "# oomguard and the tools users would pick instead",
        "",
        "Generated by `bench/peers.py`; every figure is from one run of:",
        "",
        "```",
        "python bench/peers.py " + " ".join(shlex.quote(a) for a in argv),
        "```",
        "",
        f"Machine: {machine}. The whole benchmark took {elapsed:.0f} s.",
        "",
        "| contender | global batch asked → trained | micro-batch | OOMs | s to settle | wall s | samples/s "
        "| × best that fits | steps redone |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| `{r['contender']}` | skipped: {r['skipped']} | | | | | | | |")
            continue
        drift = "" if r["trained_global"] == r["requested_global"] else " (drifted)"
        lines.append(
            f"| `{r['contender']}` | {r['requested_global']} → **{r['trained_global']}**{drift} | {r['micro_batch']} "
            f"| {r['ooms']} | {_fmt(r['settle_s'])} | {_fmt(r['wall_s'])} | {_fmt(r['samples_per_s'])} "
            f"| {_fmt(r['ratio_to_best'], 2)} | {r['steps_redone']} |")
    if "skipped" not in sweep_row:
        sizes = ", ".join(f"{m}: {v}" for m, v in sweep_row["fits"].items())
        lines += ["", f"Sweep (samples/s at each micro-batch that fits): {sizes}. Best that fits: micro-batch "
                  f"{sweep_row['micro_batch']} at {sweep_row['samples_per_s']} samples/s; the largest size that fits "
                  f"is {sweep_row['largest_fitting']}, {sweep_row['smallest_failing']} does not."]
    again = next((r["second_run"] for r in rows if "second_run" in r), None)
    if again:
        lines += ["", f"`oomguard-run` again on the same job (a new run directory, the fit store the first run left): "
                  f"{again['ooms']} OOMs, micro-batch {again['micro_batch']}, global {again['trained_global']}, "
                  f"settled in {again['settle_s']} s, {again['wall_s']} s wall. The rows above start from an empty "
                  "fit store."]
    if splits:
        lines += ["", "Where an `oomguard-run` restart's time goes (seconds, from the OOM to the next attempt's first "
                  "optimizer step; the script's own records and oomguard's journal):", "",
                  "| restart | " + " | ".join(SEGMENTS) + " | total |", "|---" * (len(SEGMENTS) + 2) + "|"]
        for i, s in enumerate(splits, 1):
            then = "" if s["then"] == "step" else " (OOM again)"
            total = sum(s[seg] for seg in SEGMENTS)
            lines.append(f"| {i}{then} | " + " | ".join(f"{s[seg]:.2f}" for seg in SEGMENTS) + f" | {total:.2f} |")
    lines += ["", "How each contender runs (each script in `bench/peerkit/` says what of the tool's source and "
              "documentation it follows):", "", *(f"- `{name}`: {HOW[name]}" for name in CONTENDERS)]
    lines += ["", "Columns: the global batch asked for and the one the last optimizer step really trained on "
              "(the samples whose backward completed, from the model's own records); the micro-batch of that step; "
              "OOMs (forwards whose backward never completed); seconds from launch to the first optimizer step at "
              "the settled size; wall seconds from launch to exit; samples/s once settled (median over the settled "
              "steps) and its ratio to the best the sweep measured; optimizer steps run beyond the asked number "
              "(thrown away or done twice).", "", "![oomguard and its peers](peers.png)", ""]
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def chart(rows: Sequence[dict[str, Any]], best: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "skipped" not in r]
    names = [r["contender"] for r in ran]
    colors = ["#2b6cb0" if n in OURS else "#a0aec0" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    panels = [("global batch trained (asked: dashed)", "trained_global", ran[0]["requested_global"] if ran else None),
              ("samples/s once settled (best that fits: dashed)", "samples_per_s", best),
              ("seconds to settle (dark) and wall (light)", "wall_s", None)]
    for ax, (title, key, line) in zip(axes, panels, strict=True):
        values = [r[key] or 0 for r in ran]
        ax.barh(names, values, color=colors if key != "wall_s" else "#cbd5e0")
        if key == "wall_s":
            ax.barh(names, [r["settle_s"] or 0 for r in ran], color=colors)
        if line:
            ax.axvline(line, color="#c53030", linestyle="--")
        ax.set_title(title, fontsize=10)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:g}", va="center", fontsize=8)
        ax.margins(x=0.18)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_line(device: str, load_at_start: float) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    where = f"{os.cpu_count()}-core CPU ({cpu}), 1 training thread per contender"
    if device == "cuda":
        import torch

        where = f"{torch.cuda.get_device_name()} with {where}"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # Other work on the box slows every contender alike but makes the figures noisier: say how busy it was.
    load = f"1-minute load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    return f"{where}; Python {platform.python_version()}, torch {importlib.metadata.version('torch')}; {stamp}; {load}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps each contender must train")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the rows to FILE as a JSON list")
    p.add_argument("--global-batch", type=int, default=64, help="the global batch asked for (also the micro-batch)")
    p.add_argument("--budget-mb", type=int, default=None,
                   help="memory each process may add after its first forward (default: 180 on CPU, 120 on CUDA); "
                   "pick it so that --global-batch does not fit")
    p.add_argument("--sweep-steps", type=int, default=8, help="steps timed at each size of the sweep")
    p.add_argument("--no-bisect", dest="bisect", action="store_false",
                   help="sweep only the divisors of the global batch (no search for the largest size that fits)")
    p.add_argument("--no-second-run", dest="second_run", action="store_false",
                   help="do not run oomguard-run a second time with the fit store the first run left")
    p.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS), metavar="NAME",
                   help=f"run only these contenders (the sweep always runs): {', '.join(CONTENDERS)}")
    p.add_argument("--docs", type=Path, default=DOCS, help="where peers.md and peers.png go ('-': nowhere)")
    p.add_argument("--work", type=Path, default=None, help="keep the records and run directories here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one contender may take")
    args = p.parse_args(argv)
    if args.budget_mb is None:
        args.budget_mb = 120 if args.device == "cuda" else 180
    if args.steps < 2:
        p.error("--steps must be at least 2 (samples/s needs two steps)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began, load = time.time(), os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="oomguard-peers-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        sweep_row, _ = sweep(args, work)
        best = sweep_row.get("samples_per_s")
        splits: list[dict[str, Any]] = []
        for name in args.only:
            row, out = contender_row(name, args, work, best)
            rows.append(row)
            if name == "oomguard-run" and out is not None and "skipped" not in row:
                splits = row["restart_split"] = restart_split(read_records(out.records), work / "run")
                if args.second_run:
                    row["second_run"] = second_run(args, work)
    elapsed = time.time() - began
    result = [*rows, sweep_row]
    given = list(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, sweep_row, splits, given, machine_line(args.device, load), elapsed)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if str(args.docs) != "-":
        args.docs.mkdir(parents=True, exist_ok=True)
        (args.docs / "peers.md").write_text(text)
        chart(rows, best, args.docs / "peers.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
