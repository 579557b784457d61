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
First the sizes that fit are found (the divisors of the global batch, then a bisection for the
largest size that fits, each probe in a fresh process). Then ``--rounds`` rounds run every job
once, in an order rotated each round: each contender, the sweep (the plain script oomguard-run
supervises, ``peerkit/train_plain.py``, at each fitting size in a process of its own, timed by the
same records, so "the best that fits" is measured the way the contenders run) and a self-check (the
best divisor made ``--check`` slower, which must come out slower in every round). Every figure is
the median over the rounds with its min–max; ratios are paired within a round.

The clock: on CPU a step is timed by the training thread's own CPU time (``--clock cpu``; each
record carries ``time.thread_time()``), because on a shared core another process's turn stretches
a step's wall time by its whole length; and a canary (``--canary``, on by default on CPU: the
plain script at the best divisor, training without end on the jobs' CPU through the round) is
timed in the same seconds as each job, and ratios are taken over it, because what other processes
do to the core's caches and the memory bandwidth still moves CPU time. A run's rate is made from its
per-step rates by ``--stat``: ``q1`` (default), one over the lower quartile of the per-step seconds per
sample, since that interference only ever adds time; or the median. On CUDA: wall clock, every
timed record after ``torch.cuda.synchronize()``, no canary.

    python bench/peers.py --json docs/peers.json               # CPU: 40-50 minutes on 2 loaded cores
    python bench/peers.py --device cuda --docs /tmp/cuda --json peers-cuda.json   # not yet run on a GPU
    bash scripts/gpu_check_peers.sh     # the same, sized for a lent GPU machine's 10-minute command

Writes docs/peers.md (the table, the exact command and machine) and docs/peers.png (the chart; where
matplotlib is installed); with ``--device cuda``, docs/peers-cuda.md and docs/peers-cuda.png.
``--render FILE`` writes them again from a saved ``--json`` result without running anything.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
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

OURS = ("oomguard-run", "oomguard-run-measured", "oomguard-run-grow", "oomguard-run-predict", "oomguard-session")
RUNS = ("oomguard-run", "oomguard-run-measured", "oomguard-run-grow", "oomguard-run-predict")  # `oomguard run`
FLAGS = {  # contender -> the flags it adds to oomguard-run's command (checked against `oomguard run --help`)
    "oomguard-run-grow": ("--grow",),
    "oomguard-run-predict": ("--grow", "--predict-shrink"),
}
GROW_SAVE_EVERY = 2  # --grow restarts at the next checkpoint after its stable period: the grow rows save often
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
    "oomguard-run-measured": "the same `oomguard run` again, with a copy of the fit store a first run of the same "
                             "job left (same script, device and limit): it starts at the largest size known to fit.",
    "oomguard-run-grow": "the same `oomguard run` with `--grow --grow-after S`: it halves after each OOM as "
                         "`oomguard-run` does, then, stable for S seconds, restarts at the next checkpoint (the script "
                         f"saves every {GROW_SAVE_EVERY} steps) at the larger micro-batch its memory model predicts "
                         "fits.",
    "oomguard-run-predict": "`oomguard run --grow --predict-shrink --grow-after S`: after an OOM it restarts at the "
                            "size its memory model predicts fits instead of halving; growth as `oomguard-run-grow`.",
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
    t: float  # wall clock when the step was done
    samples: int  # samples whose completed backward went into this optimizer step
    micro: int  # the largest micro-batch among them
    pid: int
    cpu: float | None = None  # the training thread's CPU time then (records before it had none)
    usage: dict[str, float] | None = None  # the thread's getrusage figures then (workload.thread_usage)


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
            usage = {k: rec[k] for k in ("minflt", "utime", "stime")} if "minflt" in rec else None
            out.steps.append(Step(rec["t"], samples, micro, rec["pid"], rec.get("cpu"), usage))
    settle_pending()
    return out


def summarize(name: str, tr: Trace, launch: float, end: float, requested: int, steps: int,
              best: float | None, clock: str = "wall", stat: str = "median") -> dict[str, Any]:
    """The contender's row of the table (the issue's keys); samples/s by ``clock`` ("cpu": the
    training thread's CPU time; "wall") and ``stat`` (see STATS), and by wall too when that is not
    the table's clock; ``by_stat``: the rate by every statistic, to compare them on the same steps."""
    if not tr.steps:
        return {"contender": name, "skipped": "no optimizer step completed (see the error above)"}
    last = tr.steps[-1]
    last_oom = max(tr.ooms) if tr.ooms else float("-inf")
    settled = [s for s in tr.steps if s.t > last_oom and s.micro == last.micro]
    rate = steady_rate(settled, clock, stat)
    wall = steady_rate(settled, "wall", stat) if clock != "wall" else rate
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
        "wall_samples_per_s": round(wall, 1) if wall else None,
        "window": [timed_steps(settled)[0].t, settled[-1].t] if len(settled) > 1 else None,
        "by_stat": {k: steady_rate(settled, clock, k) for k in STATS},
        "usage": step_usage(timed_steps(settled)),
    }


def step_usage(steps: Sequence[Step]) -> dict[str, float] | None:
    """Per timed step (median over the intervals within one process): the thread's minor page
    faults and its user and system CPU seconds (``getrusage``, stamped in each step's record)."""
    per: dict[str, list[float]] = {"minflt": [], "utime": [], "stime": []}
    for a, b in zip(steps, steps[1:], strict=False):
        if a.pid == b.pid and a.usage and b.usage:
            for k, values in per.items():
                values.append(b.usage[k] - a.usage[k])
    return {k: statistics.median(v) for k, v in per.items()} if per["minflt"] else None


WARMUP_STEPS = 2  # settled steps left out of the timed window: allocator pools, first-touch pages, caches


def step_rates(settled: Sequence[Step], clock: str = "wall") -> list[float]:
    """Each step's samples over the time since the step before it in the same process, by
    ``clock``: "wall", or "cpu", the training thread's own CPU time, which another process's share
    of a loaded core does not move (and which restarts from zero in a new process, so an interval
    never spans two)."""
    def at(s: Step) -> float | None:
        return s.t if clock == "wall" else s.cpu

    rates = []
    for a, b in zip(settled, settled[1:], strict=False):
        ta, tb = at(a), at(b)
        if a.pid == b.pid and ta is not None and tb is not None and tb > ta:
            rates.append(b.samples / (tb - ta))
    return rates


# How a run's per-step rates make its one rate. "q1": one over the lower quartile of the seconds per
# sample. Chosen before the self-check run it is judged by (docs/peers.md, notes): what other
# processes do to the core (its caches, the memory bandwidth) only ever adds CPU time to a step, never
# takes any away, so the least disturbed steps are the closest to the step's own cost, and a quartile
# is not one lucky step. "median": the median of the per-step rates (the table before).
STATS = ("q1", "median")


def typical(rates: Sequence[float], stat: str = "median") -> float | None:
    """One rate from per-step rates by ``stat`` (see STATS)."""
    if not rates:
        return None
    if stat == "median":
        return statistics.median(rates)
    seconds = [1.0 / r for r in rates]
    q1 = statistics.quantiles(seconds, n=4, method="inclusive")[0] if len(seconds) > 1 else seconds[0]
    return 1.0 / q1


def steady_rate(settled: Sequence[Step], clock: str = "wall", stat: str = "median") -> float | None:
    """Samples/s once settled: each step's samples over the time since the step before (by
    ``clock``), over the settled steps after the first ``WARMUP_STEPS`` (the warm-up is outside the
    timed window; with too few steps for that, whatever is left after the first interval), made one
    by ``stat``."""
    return typical(step_rates(timed_steps(settled), clock), stat)


def timed_steps(settled: Sequence[Step]) -> Sequence[Step]:
    """The settled steps whose intervals are timed: all but the first ``WARMUP_STEPS`` intervals
    (with too few for that, all but the first)."""
    intervals = len(settled) - 1
    skip = WARMUP_STEPS if intervals > WARMUP_STEPS + 1 else min(1, intervals - 1)
    return settled[max(skip, 0):]


def window_rate(steps: Sequence[Step], window: Sequence[float], clock: str = "cpu", stat: str = "median"
                ) -> float | None:
    """The median rate of the canary's steps that overlap ``window`` (wall seconds, from the first
    to the last timed step of a job: the steps inside and the one on each side of it): how fast the
    same work ran on this box then."""
    before = [i for i, s in enumerate(steps) if s.t < window[0]]
    after = [i for i, s in enumerate(steps) if s.t > window[1]]
    first = before[-1] if before else 0
    last = after[0] if after else len(steps) - 1
    return typical(step_rates(steps[first:last + 1], clock), stat)


# ----- what runs: contenders, the sweep's fixed sizes and the self-check, each a job


@dataclass(frozen=True)
class Job:
    """One process tree to time: a contender, or the plain script at one fixed size (the sweep);
    ``slowdown`` makes it wait that share of each step (the self-check's slower variant)."""

    label: str
    kind: str  # a contender's name, or "sweep"
    micro: int | None = None
    slowdown: float = 0.0


def sweep_job(micro: int, slowdown: float = 0.0) -> Job:
    label = f"sweep@{micro}" + (f" slowed {slowdown:.0%}" if slowdown else "")
    return Job(label, "sweep", micro, slowdown)


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
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
    if args.cpu is not None:
        env["PEERS_CPU"] = str(args.cpu)
    return env


def plain_command(args: argparse.Namespace, micro: int, steps: int, out: Path) -> list[str]:
    """The plain script at one fixed size, as the sweep runs it (and as oomguard-run's worker runs it
    once settled: the same file, loop, checkpoint writes and records)."""
    g = args.global_batch
    accum = -(-g // micro)
    return [sys.executable, str(KIT / "train_plain.py"), "--batch-size", str(micro), "--gradient-accumulation-steps",
            str(accum), "--global-batch", str(g), "--steps", str(steps), "--output", str(out)]


def command_for(job: Job, args: argparse.Namespace, work: Path, fitstore: Path | None = None
                ) -> tuple[list[str], dict[str, str]]:
    g, n = str(args.global_batch), str(args.steps)
    records = work / "records.jsonl"
    if job.kind == "sweep":
        assert job.micro is not None
        env = worker_env(args, records, PEERS_SLOWDOWN=str(job.slowdown))
        if job.slowdown:
            # The self-check is a timing check, not a fit check: uncapped, so a best divisor at the
            # budget's edge cannot OOM it (it did once, and a round without it proves nothing).
            env["PEERS_BUDGET_MB"] = "0"
        return plain_command(args, job.micro, args.steps, work / "ckpt"), env
    if job.kind in RUNS:
        ckpt = work / "ckpt"
        flags = list(FLAGS.get(job.kind, ()))
        saves = ["--save-every", str(GROW_SAVE_EVERY)] if flags else []
        cmd = [sys.executable, "-m", "oomguard", "run", "--run-dir", str(work / "run"), "--no-web",
               "--global-batch", g, "--micro-batch", g, "--checkpoint", str(ckpt / "checkpoint-*"),
               "--resume-args", "--resume-from {checkpoint}",
               *(flags + ["--grow-after", str(args.grow_after)] if flags else []), "--",
               # The script itself, as a user runs it: a wrapper between oomguard and the script (this
               # benchmark's exit stamp did, until 2026-11-25) makes the wrapper the worker, and
               # oomguard's spare interpreter, which pre-imports the script's modules, never applies.
               sys.executable, str(KIT / "train_plain.py"), "--batch-size", "{micro_batch}",
               "--gradient-accumulation-steps", "{grad_accum}", "--steps", n, "--output", str(ckpt), *saves]
        # oomguard-run: an empty fit store (a remembered size would skip the OOMs this benchmark is
        # about); oomguard-run-measured: a copy of the store a first run of the same job left.
        store = work / "fitstore"
        if fitstore is not None:
            shutil.copytree(fitstore, store, dirs_exist_ok=True)
        return cmd, worker_env(args, records, OOMGUARD_CACHE_DIR=str(store))
    cmd = [sys.executable, str(KIT / SCRIPTS[job.kind]), "--global-batch", g, "--steps", n]
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


def run_help() -> str:
    """``oomguard run --help`` of the oomguard this benchmark runs (the tree it sits in)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "oomguard", "run", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    return proc.stdout


def missing_flags(name: str, help_text: str) -> str | None:
    """Why a contender whose flags this oomguard does not have is skipped (None: it has them all)."""
    # the flag as a whole word: "--grow" must not be found in "--grow-after"
    missing = [f for f in FLAGS.get(name, ()) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]
    if not missing:
        return None
    return f"this oomguard has no {', '.join(missing)} (`oomguard run --help` does not list it)"


def skip_reason(name: str, device: str, help_text: str = "") -> str | None:
    if name in FLAGS:
        return missing_flags(name, help_text or run_help())
    module = NEEDS.get(name)
    installed = module is None or importlib.util.find_spec(module) is not None
    if name == "composer-auto-microbatch":
        why = [] if installed else [COMPOSER_WHY]
        why += [COMPOSER_CPU] if device == "cpu" else []
        why += [] if why else ["no Composer script yet (Composer could not be installed here to test one)"]
        return "; ".join(why)
    return None if installed else f"{module} is not installed: pip install -e '.[bench]'"


def run_job(job: Job, args: argparse.Namespace, work: Path, seed: Path | None) -> tuple[dict[str, Any], Outcome]:
    """Run one job in a fresh directory of its own; its row (not yet compared with the sweep)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd, env = command_for(job, args, work, seed if job.kind == "oomguard-run-measured" else None)
    out = run(job.label, cmd, env, work, args.timeout)
    row = summarize(job.label, trace(read_records(out.records)), out.launch, out.end, args.global_batch, args.steps,
                    None, args.clock, args.stat)
    if out.returncode != 0:
        row = {"contender": job.label, "skipped": f"exited {out.returncode}: {out.stderr.strip()[-300:]}"}
    if job.kind in RUNS and "skipped" not in row:
        row["restart_split"] = restart_split(read_records(out.records), work / "run")
    print(f"  {job.label}: {json.dumps({k: v for k, v in row.items() if k != 'restart_split'})}", flush=True)
    return row, out


# ----- which sizes fit (each probed in a fresh process)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fits(args: argparse.Namespace, micro: int, work: Path) -> bool:
    """Does the plain script train ``--fit-steps`` steps at ``micro`` under the budget?"""
    where = work / f"fit-{micro}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    cmd = plain_command(args, micro, args.fit_steps, where / "ckpt")
    out = run(f"fit@{micro}", cmd, worker_env(args, where / "records.jsonl"), where, args.timeout)
    ok = out.returncode == 0
    if not ok and "can't allocate memory" not in out.stderr and "out of memory" not in out.stderr:
        raise RuntimeError(f"the plain script failed at micro-batch {micro} for a reason other than memory: "
                           f"{out.stderr.strip()[-500:]}")
    print(f"  micro-batch {micro}: {'fits' if ok else 'does not fit'}", flush=True)
    return ok


def find_fits(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The divisors of the global batch that fit (from the largest down to the first that fits:
    memory grows with the micro-batch, so every smaller one fits too), then a bisection for the
    largest size that fits, divisor or not."""
    failing: int | None = None
    low = 0
    for d in reversed(divisors(args.global_batch)):
        if fits(args, d, work):
            low = d
            break
        failing = d
    fitting = [d for d in divisors(args.global_batch) if d <= low]
    high = failing
    while args.bisect and high is not None and high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(args, mid, work) else (low, mid)
    return {"fitting_divisors": fitting, "largest_fitting": low, "smallest_failing": high}


# ----- rounds: every job once per round, the order rotated, so load that comes and goes hits all alike


def rotated(jobs: Sequence[Job], round_index: int, rounds: int) -> list[Job]:
    shift = (round_index * len(jobs)) // max(rounds, 1)
    return [*jobs[shift:], *jobs[:shift]]


def spread(values: Sequence[float | None]) -> dict[str, float] | None:
    """Median and min–max of the figures the rounds measured (None when no round measured it)."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def paired(numer: Sequence[dict[str, Any]], denom: Sequence[dict[str, Any]], key: str = "samples_per_s"
           ) -> list[float | None]:
    """Per round, one job's samples/s over another's measured in the same round (load drift between
    rounds cancels); with ``key="vs_canary"``, each over the canary's rate while it ran (load that
    changed within the round cancels too)."""
    out: list[float | None] = []
    for a, b in zip(numer, denom, strict=True):
        x, y = a.get(key), b.get(key)
        out.append(x / y if x and y else None)
    return out


def aggregate(label: str, per_round: Sequence[dict[str, Any]], best: Sequence[dict[str, Any]] | None,
              same_size: dict[int, list[dict[str, Any]]], key: str = "samples_per_s") -> dict[str, Any]:
    """A contender's row: each figure's median and min–max over the rounds; × best that fits and
    × the sweep at the contender's own settled size, paired round by round (by ``key``)."""
    ran = [r for r in per_round if "skipped" not in r]
    if not ran:
        return {"contender": label, "skipped": per_round[0]["skipped"] if per_round else "did not run"}
    row: dict[str, Any] = {"contender": label, "rounds": list(per_round)}
    for figure in ("requested_global", "trained_global", "micro_batch", "ooms", "settle_s", "wall_s", "samples_per_s",
                   "wall_samples_per_s", "canary_samples_per_s", "steps_redone"):
        row[figure] = spread([r.get(figure) for r in ran])
    row["ratio_to_best"] = spread(paired(per_round, best, key)) if best else None
    micro = int(row["micro_batch"]["median"]) if row["micro_batch"] else None
    if micro in same_size and label not in (f"sweep@{micro}",):
        row["ratio_to_same_size"] = spread(paired(per_round, same_size[micro], key))
    return row


# ----- the restart path: where the time between an OOM and the next first step goes

SEGMENTS = ("oom to atexit", "teardown, notice and decide", "spawn", "interpreter start", "imports",
            "model build", "data", "first step")  # "first step": or, when the size fails too, its OOM
# Results saved before 2026-11-25 split the teardown off with a wrapper (which kept the spare out).
_MERGED = {"teardown, notice and decide": ("teardown", "notice and decide")}


def _merged(split: dict[str, Any]) -> dict[str, Any]:
    """A split saved with the older, finer segments, in today's."""
    merged = dict(split)
    for seg, parts in _MERGED.items():
        if seg not in merged and all(p in merged for p in parts):
            merged[seg] = sum(merged[p] for p in parts)
    return merged


def restart_split(records: Sequence[dict[str, Any]], run_dir: Path) -> list[dict[str, Any]]:
    """For each restart: seconds from the OOM (the script's excepthook record) to its atexit
    record, to the supervisor's decision (journal: attempt ended; the interpreter's teardown, its
    reaping and the decision), to the next worker's spawn (journal: attempt started), to
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
        if rec["ev"] in ("proc", "imported", "model", "data", "exception", "exit", "opt"):
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
        points = [failed["exception"], exited, ended, started,
                  *(following[k] for k in needed), end]
        split: dict[str, Any] = {seg: round(b - a, 3)
                                 for seg, a, b in zip(SEGMENTS, points[:-1], points[1:], strict=True)}
        split["then"] = "step" if "opt" in following else "oom"
        splits.append(split)
    return splits




# ----- output


def fmt(figure: dict[str, float] | None, digits: int = 1) -> str:
    """``median (min–max)``, or the one value when every round agreed."""
    if figure is None:
        return "–"
    med, lo, hi = (f"{figure[k]:.{digits}f}" for k in ("median", "min", "max"))
    return med if lo == hi else f"{med} ({lo}–{hi})"


def _count(figure: dict[str, float] | None) -> str:
    return fmt(figure, 0)


def other_stats(check: dict[str, Any], stat: str) -> str:
    """The self-check's rounds by the statistics the table does not use (same steps, for comparison)."""
    others = {k: v for k, v in (check.get("ratios_by_stat") or {}).items() if k != stat}
    return "".join(f" By the {k} instead (not the table's statistic), round by round: "
                   + ", ".join("–" if x is None else f"{x:.3f}" for x in v)
                   + (" (told apart in every round)." if told_apart(v) else " (NOT told apart in every round).")
                   for k, v in others.items())


CLOCKS = {"cpu": "samples per CPU second", "wall": "samples/s"}


def table_line(r: dict[str, Any], clock: str = "wall") -> str:
    wall = "" if clock == "wall" else f" {fmt(r.get('wall_samples_per_s'))} |"
    if "skipped" in r:
        return f"| `{r['contender']}` | skipped: {r['skipped']} | | | | | | | |" + (" |" if wall else "")
    asked, trained = r["requested_global"]["median"], r["trained_global"]
    drift = "" if trained["min"] == trained["max"] == asked else " (drifted)"
    return (f"| `{r['contender']}` | {asked:.0f} → **{_count(trained)}**{drift} | {_count(r['micro_batch'])} "
            f"| {_count(r['ooms'])} | {fmt(r['settle_s'])} | {fmt(r['wall_s'])} | {fmt(r['samples_per_s'])} "
            f"| {fmt(r['ratio_to_best'], 3)} | {fmt(r.get('ratio_to_same_size'), 3)} |{wall} "
            f"{_count(r['steps_redone'])} |")


def markdown(result: dict[str, Any], argv: Sequence[str], machine: str, elapsed: float, drawn: bool = True,
             name: str = "peers") -> str:
    rows, fit, check = result["contenders"], result["fits"], result["check"]
    clock = result.get("clock", "wall")
    wall_col = "" if clock == "wall" else " samples/s by wall |"
    lines = [
        "# oomguard and the tools users would pick instead",
        "",
        "Generated by `bench/peers.py`; every figure is from one run of:",
        "",
        "```",
        "python bench/peers.py " + " ".join(shlex.quote(a) for a in argv),
        "```",
        "",
        f"Machine: {machine}. {result['rounds']} rounds, every job once per round in a rotated order; the "
        f"whole benchmark took {elapsed:.0f} s. Each figure is the median over the rounds, with the lowest and "
        "highest in brackets when they differ.",
        "",
        CLOCK_WHY[clock],
        "",
        f"| contender | global batch asked → trained | micro-batch | OOMs | s to settle | wall s | {CLOCKS[clock]} "
        f"| × best that fits | × sweep at its size |{wall_col} steps redone |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if wall_col else ""),
        *(table_line(r, clock) for r in rows),
    ]
    sweep = result["sweep"]
    if sweep:
        sizes = ", ".join(f"{s['micro']}: {fmt(s['samples_per_s'])}" for s in sweep)
        lines += ["", f"Sweep (the plain script `bench/peerkit/train_plain.py` at one fixed micro-batch per process, "
                  f"timed by the same records and clock as the contenders; {CLOCKS[clock]}): {sizes}. "
                  "Best that fits: micro-batch "
                  f"{result['best_micro']}. The divisors that fit: {fit['fitting_divisors']}; the largest size that "
                  f"fits is {fit['largest_fitting']}, {fit['smallest_failing']} does not."]
    if result.get("canary") and check:
        raw = ", ".join("–" if x is None else f"{x:.3f}" for x in check.get("ratios_without_canary") or [])
        where = f"CPU {result['canary_cpu']}" if result.get("canary_cpu") is not None else "not pinned"
        lines += ["", CANARY.format(micro=check["micro"], raw=raw, where=where)]
    if check:
        lines += ["", f"Self-check: the plain script at micro-batch {check['micro']}, made "
                  f"{check['slowdown']:.0%} slower (it spins for that share of each step), against the same size "
                  f"unslowed in the same round: {fmt(check['ratio'], 3)} (expected {1 / (1 + check['slowdown']):.3f}; "
                  f"round by round: {', '.join('–' if x is None else f'{x:.3f}' for x in check.get('ratios', []))}); "
                  + ("told apart in every round." if check["told_apart"] else
                     "NOT told apart in every round: " + ("; ".join(check["missed"]) if check.get("missed") else
                                                          f"the spread here is wider than {check['slowdown']:.0%}."))
                  + other_stats(check, result.get("stat", "median"))]
    lines += [x for note in result.get("notes", []) for x in ("", note)]  # added to a saved result by hand
    splits = [(f"{r + 1}.{i}", s) for r, run_splits in enumerate(result["restart_splits"])
              for i, s in enumerate(run_splits, 1)]
    if splits:
        lines += ["", "Where an `oomguard-run` restart's time goes (seconds, from the OOM to the next attempt's first "
                  "optimizer step; the script's own records and oomguard's journal; round.restart):", "",
                  "| restart | " + " | ".join(SEGMENTS) + " | total |", "|---" * (len(SEGMENTS) + 2) + "|"]
        for label, s in splits:  # not `name`: that is the chart's file name below
            s = _merged(s)
            then = "" if s["then"] == "step" else " (OOM again)"
            total = sum(s[seg] for seg in SEGMENTS)
            lines.append(f"| {label}{then} | " + " | ".join(f"{s[seg]:.2f}" for seg in SEGMENTS) + f" | {total:.2f} |")
    lines += ["", "How each contender runs (each script in `bench/peerkit/` says what of the tool's source and "
              "documentation it follows):", "", *(f"- `{c}`: {HOW[c]}" for c in CONTENDERS)]
    reading = READING.format(how=STAT_HOW[result.get("stat", "median")])
    lines += ["", reading, ""] + ([f"![oomguard and its peers]({name}.png)", ""] if drawn else [])
    return "\n".join(lines)


CLOCK_WHY = {
    "cpu": "Clock: on CPU every rate is samples over the training thread's own CPU time (`time.thread_time()`, "
           "stamped in each optimizer step's record; one intra-op thread, so the thread is the training). Why: on "
           "this shared 2-core box other processes take turns on the core, which stretches a step's wall time by "
           "however long they ran; by wall clock the 5 % self-check came out 1.27x *faster* (the table this one "
           "replaces), and here the wall rate of one job swung from 38 to 97 samples/s. A thread's CPU time does "
           "not count other processes' turns, but it still grows with what they do to the core's caches and the "
           "memory bandwidth (up to 10 % within one job here), so every rate is also paired with the canary "
           "below. The wall-clock rate is in its own column for the reader who wants it; settle and wall seconds "
           "are wall clock.",
    "wall": "Clock: samples/s is samples over wall time between optimizer steps; on CUDA every timed record "
            "waits for `torch.cuda.synchronize()` first, so a step is stamped when its kernels are done.",
}

STAT_HOW = {"median": "the median of the per-step rates",
            "q1": "one over the lower quartile of the per-step seconds per sample (what other processes do to the "
                  "core only adds time, so the least disturbed steps are the closest to the step's own cost)"}

READING = (
    "How to read it. Columns: the global batch asked for and the one the last optimizer step really trained on "
    "(the samples whose backward completed, from the model's own records); the micro-batch of that step; OOMs "
    "(forwards whose backward never completed); seconds from launch to the first optimizer step at the settled "
    "size (wall); wall seconds from launch to exit; the rate once settled, by the clock named above: {how} "
    f"over the settled steps after the first {WARMUP_STEPS} (the warm-up is outside the timed "
    "window; an interval never spans two processes); × best that fits: that rate over the best sweep size's rate "
    "measured in the same round (a paired ratio, so load that changes between rounds cancels; with the canary, "
    "each rate is first taken over the canary's rate in the same seconds, so load that changes within a round "
    "cancels too); × sweep at its size: the same against the sweep at the contender's own settled micro-batch (for "
    "`oomguard-run` the same script, loop and timing, so this is the supervisor's tax plus noise); optimizer steps "
    "run beyond the asked number (thrown away or done twice). The sweep runs the very script `oomguard-run` "
    "supervises, so `oomguard-run`'s × best that fits is at most 1 within its spread by construction; a framework "
    "peer's loop is its own and may be faster or slower than the plain loop at the same size. The grow rows save "
    "a checkpoint every few steps (growth restarts at one), which their rate pays. A difference is real when it is "
    "larger than the brackets; the self-check line says whether a 5 % slower variant stood apart.")

CANARY = (
    "Canary: through every round the plain script at micro-batch {micro} trains without end, pinned to the same "
    "CPU as the jobs ({where}); each job's rate is also taken over the canary's rate in the seconds the job was "
    "timed. The thread's CPU time is not moved by other processes' turns on the core, but it is by what they do "
    "to its caches and to the memory bandwidth (heavy imports, test suites), for as long as they run; the canary "
    "shares the core and feels that at the same moment, so the ratio cancels it. Sharing the core, each job gets "
    "about half of it: the wall-clock figures (settle, wall, samples/s by wall) are those of a core shared with the "
    "canary, alike for every job. The self-check without the canary, round by round: {raw}.")


def chart(rows: Sequence[dict[str, Any]], best: float | None, path: Path, clock: str = "wall") -> bool:
    """Draw the chart; False (and a line saying so) where matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: {path} not drawn (pip install -e '.[bench]')", flush=True)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "skipped" not in r]
    names = [r["contender"] for r in ran]
    colors = ["#2b6cb0" if n.startswith("oomguard") else "#a0aec0" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    asked = ran[0]["requested_global"]["median"] if ran else None
    panels = [("global batch trained (asked: dashed)", "trained_global", asked),
              (f"{CLOCKS[clock]} once settled, min–max (best that fits: dashed)", "samples_per_s", best),
              ("seconds to settle (dark) and wall (light)", "wall_s", None)]
    for ax, (title, key, line) in zip(axes, panels, strict=True):
        figs = [r[key] or {"median": 0.0, "min": 0.0, "max": 0.0} for r in ran]
        values = [f["median"] for f in figs]
        err = [[v - f["min"] for v, f in zip(values, figs, strict=True)],
               [f["max"] - v for v, f in zip(values, figs, strict=True)]]
        ax.barh(names, values, color=colors if key != "wall_s" else "#cbd5e0", xerr=err, capsize=3)
        if key == "wall_s":
            ax.barh(names, [(r["settle_s"] or {"median": 0.0})["median"] for r in ran], color=colors)
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
    return True


def machine_line(device: str, load_at_start: float, cpu_pin: int | None) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    pin = f", pinned to CPU {cpu_pin}" if cpu_pin is not None else ""
    where = f"{os.cpu_count()}-core CPU ({cpu}), 1 training thread per contender{pin}"
    if device == "cuda":
        import torch

        where = f"{torch.cuda.get_device_name()} with {where}"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # Other work on the box slows every contender alike but makes the figures noisier: say how busy it was.
    load = f"1-minute load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    versions = ", ".join(f"{m} {importlib.metadata.version(m)}" for m in ("torch", "transformers", "accelerate",
                                                                          "lightning") if _installed(m))
    return f"{where}; Python {platform.python_version()}, {versions}; {stamp}; {load}"


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps each contender (and each sweep size) trains")
    p.add_argument("--rounds", type=int, default=3, help="times every job runs, in a rotated order (at least 3 for "
                   "a spread worth reading)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the result to FILE as JSON")
    p.add_argument("--global-batch", type=int, default=64, help="the global batch asked for (also the micro-batch)")
    p.add_argument("--budget-mb", type=int, default=None,
                   help="memory each process may add after its first forward (default: 180 on CPU, 120 on CUDA); "
                   "pick it so that --global-batch does not fit")
    p.add_argument("--fit-steps", type=int, default=2, help="steps a size must train to count as fitting")
    p.add_argument("--sweep-min", type=int, default=4, help="time only fitting sizes from this one up (sizes 1 and 2 "
                   "were 10-25 %% slower than 8 on this CPU; --sweep-min 1 times them too)")
    p.add_argument("--check", type=float, default=0.05, help="the self-check's slowdown (0: no self-check)")
    p.add_argument("--cpu", type=int, default=None,
                   help="pin every contender's process to this CPU (default: the last one; -1: no pinning)")
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="what samples/s is timed by: the training thread's CPU time (default on CPU: other "
                   "processes on a shared core do not move it) or wall (default on CUDA, with synchronize)")
    p.add_argument("--canary", action=argparse.BooleanOptionalAction, default=None,
                   help="run the plain script on the other CPU through every round and pair each job with it "
                   "(default on CPU; never on CUDA, where it would share the GPU)")
    p.add_argument("--canary-cpu", type=int, default=None,
                   help="pin the canary to this CPU (default: the jobs' CPU, so it shares their core's caches)")
    p.add_argument("--grow-after", type=float, default=5.0, metavar="S",
                   help="--grow-after for oomguard-run-grow and -predict (oomguard's default, 600 s, is longer "
                   "than this whole run)")
    p.add_argument("--no-bisect", dest="bisect", action="store_false",
                   help="sweep only the divisors of the global batch (no search for the largest size that fits)")
    p.add_argument("--only", nargs="*", choices=CONTENDERS, default=list(CONTENDERS), metavar="NAME",
                   help=f"run only these contenders (the sweep always runs; none: only the sweep, the self-check "
                   f"and the canary): {', '.join(CONTENDERS)}")
    p.add_argument("--stat", choices=STATS, default="q1",
                   help="how a run's per-step rates make its rate: q1, one over the lower quartile of the seconds "
                   "per sample (interference only adds time: the least disturbed steps; the default), or median")
    p.add_argument("--docs", type=Path, default=DOCS, help="where peers.md and peers.png go ('-': nowhere)")
    p.add_argument("--work", type=Path, default=None, help="keep the records and run directories here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take")
    p.add_argument("--render", type=Path, default=None, metavar="FILE",
                   help="run nothing: write peers.md (and the chart) again from a result --json saved")
    args = p.parse_args(argv)
    if args.canary is None:
        args.canary = args.device == "cpu"
    if args.canary and args.device == "cuda":
        p.error("--canary runs on CPU only (on CUDA it would share the GPU with the job it measures)")
    if args.clock is None:
        args.clock = "wall" if args.device == "cuda" else "cpu"
    if args.clock == "cpu" and args.device == "cuda":
        p.error("--clock cpu on CUDA would not count the GPU's work: use --clock wall")
    if args.budget_mb is None:
        args.budget_mb = 120 if args.device == "cuda" else 180
    if args.steps < 2:
        p.error("--steps must be at least 2 (samples/s needs two steps)")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.cpu is None:
        args.cpu = (os.cpu_count() or 1) - 1
    elif args.cpu < 0:
        args.cpu = None
    return args


def plan_jobs(args: argparse.Namespace, fit: dict[str, Any]) -> tuple[list[Job], list[dict[str, Any]]]:
    """The jobs of every round (contenders that can run, the sweep's sizes, the self-check) and the
    contenders skipped with their reason."""
    jobs, skipped = [], []
    help_text = run_help() if any(name in FLAGS for name in args.only) else ""
    for name in args.only:
        why = skip_reason(name, args.device, help_text)
        if why is None:
            jobs.append(Job(name, name))
        else:
            print(f"{name}: skipped: {why}", flush=True)
            skipped.append({"contender": name, "skipped": why})
    sizes = sorted({*fit["fitting_divisors"], fit["largest_fitting"]} - {0})
    jobs += [sweep_job(m) for m in sizes if m >= args.sweep_min or m == fit["largest_fitting"]]
    if args.check and fit["fitting_divisors"]:
        jobs.append(sweep_job(max(fit["fitting_divisors"]), args.check))
    return jobs, skipped


def run_rounds(args: argparse.Namespace, work: Path, jobs: Sequence[Job], seed: Path | None,
               canary_micro: int | None = None) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {j.label: [] for j in jobs}
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", flush=True)
        with Canary(args, canary_micro, work / f"round-{r + 1}" / "canary") as canary:
            for job in rotated(jobs, r, args.rounds):
                where = work / f"round-{r + 1}" / job.label.replace(" ", "-").replace("%", "")
                row, _ = run_job(job, args, where, seed)
                canary.judge(row)
                results[job.label].append(row)
    return results


class Canary:
    """The plain script at one fitting size, training without end on the jobs' CPU while a round
    runs (``--canary``): each job's rate is also taken over the canary's rate in the same seconds
    (``vs_canary``), so what the box's other work did to that core's caches and the memory system
    then cancels."""

    def __init__(self, args: argparse.Namespace, micro: int | None, work: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.records = work / "records.jsonl"
        self.stat = args.stat
        if not args.canary or micro is None:
            return
        work.mkdir(parents=True, exist_ok=True)
        env = {**worker_env(args, self.records), "PEERS_BUDGET_MB": "0"}  # no cap: it never OOMs
        if args.canary_cpu is not None:
            env["PEERS_CPU"] = str(args.canary_cpu)
        cmd = plain_command(args, micro, 10**9, work / "ckpt")[:-2]  # no --output: no checkpoints
        self.proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.warm_up(args.timeout)

    def warm_up(self, timeout: float) -> None:
        """Wait until the canary is past its own warm-up, so no job is paired with it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc is not None and self.proc.poll() is None:
            if len(trace(read_records(self.records)).steps) > WARMUP_STEPS:
                return
            time.sleep(0.5)

    def steps(self) -> list[Step]:
        return trace(read_records(self.records)).steps[WARMUP_STEPS:]

    def __enter__(self) -> Canary:
        return self

    def judge(self, row: dict[str, Any]) -> None:
        if self.proc is None or not row.get("window") or not row.get("samples_per_s"):
            return
        steps = self.steps()
        rate = window_rate(steps, row["window"], stat=self.stat)
        row["canary_samples_per_s"] = round(rate, 1) if rate else None
        own = (row.get("by_stat") or {}).get(self.stat) or row["samples_per_s"]  # unrounded where recorded
        row["vs_canary"] = own / rate if rate else None
        row["vs_canary_by_stat"] = {}
        for k, own in (row.get("by_stat") or {}).items():
            theirs = window_rate(steps, row["window"], stat=k)
            row["vs_canary_by_stat"][k] = own / theirs if own and theirs else None

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def seed_store(args: argparse.Namespace, work: Path) -> Path | None:
    """A first ``oomguard run`` of the job, so ``oomguard-run-measured`` has a fit store to start from."""
    if "oomguard-run-measured" not in args.only:
        return None
    print("seeding the fit store: one oomguard-run", flush=True)
    where = work / "seed"
    row, _ = run_job(Job("seed", "oomguard-run"), args, where, None)
    return where / "fitstore" if "skipped" not in row else None


def missed_rounds(*jobs: Sequence[dict[str, Any]]) -> list[str]:
    """Why a round has no self-check ratio: one of its two jobs did not run through."""
    return [f"round {i + 1}: {row['contender']} {row['skipped'].splitlines()[-1][:160]}"
            for job in jobs for i, row in enumerate(job) if "skipped" in row]


def _ratio(numer: dict[str, Any], denom: dict[str, Any], stat: str, key: str) -> float | None:
    """One round's ratio of two jobs by the statistic ``stat`` (over the canary when ``key`` says so)."""
    field_ = "vs_canary_by_stat" if key == "vs_canary" else "by_stat"
    x, y = (numer.get(field_) or {}).get(stat), (denom.get(field_) or {}).get(stat)
    return x / y if x and y else None


def told_apart(ratios: Sequence[float | None]) -> bool:
    """The self-check's verdict: the slowed variant came out slower than the same size unslowed
    in every round (each round measured both; a round that missed one fails the check)."""
    return bool(ratios) and all(r is not None and r < 1.0 for r in ratios)


def summarize_rounds(args: argparse.Namespace, fit: dict[str, Any], jobs: Sequence[Job],
                     results: dict[str, list[dict[str, Any]]], skipped: list[dict[str, Any]]) -> dict[str, Any]:
    sweep_jobs = [j for j in jobs if j.kind == "sweep" and not j.slowdown]
    same_size = {j.micro: results[j.label] for j in sweep_jobs if j.micro is not None}
    sweep: list[dict[str, Any]] = [
        {"micro": j.micro, "samples_per_s": spread([r.get("samples_per_s") for r in results[j.label]]),
         "wall_samples_per_s": spread([r.get("wall_samples_per_s") for r in results[j.label]])}
        for j in sweep_jobs]
    measured = [s for s in sweep if s["samples_per_s"]]
    best = max(measured, key=lambda s: s["samples_per_s"]["median"]) if measured else None
    best_rounds = same_size[best["micro"]] if best else None
    key = "vs_canary" if args.canary else "samples_per_s"
    rows = [aggregate(j.label, results[j.label], best_rounds, same_size, key) for j in jobs if j.kind != "sweep"]
    order = {name: i for i, name in enumerate(CONTENDERS)}
    rows = sorted([*rows, *skipped], key=lambda r: order.get(r["contender"], 99))
    check = None
    slow = next((j for j in jobs if j.slowdown), None)
    if slow is not None and slow.micro in same_size:
        ratios = paired(results[slow.label], same_size[slow.micro], key)
        raw = paired(results[slow.label], same_size[slow.micro])
        by_stat = {k: [_ratio(a, b, k, key) for a, b in zip(results[slow.label], same_size[slow.micro], strict=True)]
                   for k in STATS}
        check = {"ratios_by_stat": by_stat,
                 "micro": slow.micro, "slowdown": slow.slowdown, "ratio": spread(ratios), "ratios": ratios,
                 "told_apart": told_apart(ratios), "ratios_without_canary": raw if args.canary else None,
                 "missed": missed_rounds(results[slow.label], same_size[slow.micro])}
    splits = [r.get("restart_split", []) for r in results.get("oomguard-run", [])]
    canary_cpu = args.canary_cpu if args.canary_cpu is not None else args.cpu
    return {"rounds": args.rounds, "clock": args.clock, "stat": args.stat, "canary": args.canary,
            "canary_cpu": canary_cpu,
            "fits": fit, "sweep": sweep,
            "best_micro": best["micro"] if best else None,
            "best_samples_per_s": best["samples_per_s"] if best else None, "contenders": rows, "check": check,
            "restart_splits": splits}


def write(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The table to stdout, the result to ``--json``, peers.md and peers.png to ``--docs``."""
    best = result["best_samples_per_s"]["median"] if result["best_samples_per_s"] else None
    docs = None if str(args.docs) == "-" else args.docs
    if docs is not None:
        docs.mkdir(parents=True, exist_ok=True)
    name = "peers" if result.get("device", "cpu") == "cpu" else "peers-cuda"  # the CPU and the GPU table
    drawn = docs is not None and chart(result["contenders"], best, docs / f"{name}.png", result.get("clock", "wall"))
    text = markdown(result, result["argv"], result["machine"], result["elapsed_s"], drawn, name)
    print(text)
    if args.json and args.json != args.render:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if docs is not None:
        (docs / f"{name}.md").write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:  # the docs again from a saved result, nothing run
        result = json.loads(args.render.read_text())
        result.setdefault("argv", ["--json", str(args.render)])
        write(result, args)
        return 0
    began, load = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="oomguard-peers-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("which sizes fit", flush=True)
        fit = find_fits(args, work / "fits")
        jobs, skipped = plan_jobs(args, fit)
        seed = seed_store(args, work)
        canary_micro = max(fit["fitting_divisors"]) if fit["fitting_divisors"] else None
        result = summarize_rounds(args, fit, jobs, run_rounds(args, work, jobs, seed, canary_micro), skipped)
    elapsed = time.time() - began
    result["elapsed_s"] = round(elapsed, 1)
    result["machine"] = machine_line(args.device, load, args.cpu)
    result["argv"] = list(argv if argv is not None else sys.argv[1:])
    result["device"] = args.device
    write(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
