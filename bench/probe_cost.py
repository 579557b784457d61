"""What the probe costs per optimizer step, on the smallest example's step and on a tinier one.

Two models in one process: the smallest example's (examples/train_nanogpt_style.py's TinyLM with
AdamW at its default batch of 8 x 128 tokens) and, as the worst case, a 16 x 16 linear model with
SGD (a step of tens of microseconds: the probe's fixed cost is the largest share of a step it can
be). Times are the process's CPU time, so that a loaded machine's descheduling is not counted as
either's step. Rounds of ``--steps`` steps alternate with
and without the probe's step hook (torch's global post hook, exactly what the probe registers,
writing its ``step`` records to a temporary channel every 0.5 s), so drift in a loaded machine hits
both alike. Reports the median step time of each and the spread (interquartile range) over rounds,
the probe's cost per step and its share of a step. On a loaded machine that difference is within
the noise, so the hook's own work is also timed alone (its calls in a loop) and given as a share of
the median step. The forward tracker (probe/forward.py: torch's global module hooks, armed until a
process's first optimizer step) is timed the same way: a module call with the hooks armed against
one without (what the slow path of ``Module.__call__`` and the two hooks add), times the module calls
of one step, as a share of the step it is armed for (the first), and amortized over ``--run-steps``.
Also the interpreter's start-up with and without the probe's sitecustomize
(``python -c pass``): the price paid by a process that never imports torch. And the model record
(probe/steps.py), written once per process at its first optimizer step: the digest of the
optimizer's parameters and the record's write, timed per call for a GPT-2-small-shaped model
(124M parameters in nanoGPT's two AdamW groups) on CPU (``--model-only``).

    .venv/bin/python bench/probe_cost.py --rounds 30
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from oomguard.probe import SITE_DIR, steps  # noqa: E402
from oomguard.probe.forward import ForwardTracker  # noqa: E402
from oomguard.probe.steps import StepCounter  # noqa: E402


class TinyLM(torch.nn.Module):
    """examples/train_nanogpt_style.py's model, at its defaults."""

    def __init__(self, vocab: int = 4096) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 32)
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        self.head = torch.nn.Linear(32, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        logits = self.head(x + self.block(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def nanogpt_style() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randint(0, 4096, (8, 129))


def tiny_linear() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = torch.nn.Linear(16, 16)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(4, 16)


def step_time(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> float:
    """CPU seconds per step over ``steps`` steps."""
    start = time.process_time()
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return (time.process_time() - start) / steps


def spread(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return median, q1, q3


def optimizer_steps(make: Any, rounds: int, steps: int) -> dict[str, Any]:
    model, opt, x = make()
    register = importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook
    counter = StepCounter(torch)
    step_time(model, opt, x, steps)  # warm up
    bare, probed = [], []
    for _ in range(rounds):
        bare.append(step_time(model, opt, x, steps))
        handle = register(counter.on_step)
        probed.append(step_time(model, opt, x, steps))
        handle.remove()
    calls = []  # the hook's own work, timed alone: what the step-time difference is too noisy to show
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(steps):
            counter.on_step(opt, (), {})
        calls.append((time.process_time() - start) / steps)
    (b, b1, b3), (p, p1, p3) = spread(bare), spread(probed)
    hook, h1, h3 = spread(calls)
    pairs = [q - r for q, r in zip(probed, bare, strict=True)]
    cost, c1, c3 = spread(pairs)
    return {"step_us": round(b * 1e6, 2), "step_iqr_us": [round(b1 * 1e6, 2), round(b3 * 1e6, 2)],
            "probed_step_us": round(p * 1e6, 2), "probed_iqr_us": [round(p1 * 1e6, 2), round(p3 * 1e6, 2)],
            "cost_us": round(cost * 1e6, 3), "cost_iqr_us": [round(c1 * 1e6, 3), round(c3 * 1e6, 3)],
            "cost_share_pct": round(100 * cost / b, 3),
            "hook_us": round(hook * 1e6, 3), "hook_iqr_us": [round(h1 * 1e6, 3), round(h3 * 1e6, 3)],
            "hook_share_pct": round(100 * hook / b, 4), "counted": counter.step, "rounds": rounds, "steps": steps}


def module_calls(make: Any) -> int:
    """How many module forwards one step of ``make``'s model runs."""
    model, _, x = make()
    calls = [0]

    def count(module: Any, args: Any) -> None:
        calls[0] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        model(x).sum().backward()
    finally:
        handle.remove()
    return calls[0]


def call_time(module: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        module(x)
    return (time.process_time() - start) / calls


def forward_tracker(make: Any, step_us: float, rounds: int, run_steps: int, calls: int = 20000) -> dict[str, Any]:
    """The armed tracker's cost per module call (hooks armed vs none, interleaved rounds), per step."""
    tiny, x = torch.nn.Identity(), torch.zeros(1)
    tracker = ForwardTracker(torch)
    call_time(tiny, x, calls)  # warm up
    bare, armed = [], []
    for _ in range(rounds):
        bare.append(call_time(tiny, x, calls))
        tracker.arm()
        tracker.forget()
        armed.append(call_time(tiny, x, calls))
        tracker.disarm()
    pairs = [a - b for a, b in zip(armed, bare, strict=True)]
    per_call, c1, c3 = spread(pairs)
    n = module_calls(make)
    per_step = per_call * n * 1e6
    return {"per_call_us": round(per_call * 1e6, 3), "per_call_iqr_us": [round(c1 * 1e6, 3), round(c3 * 1e6, 3)],
            "module_calls_per_step": n, "armed_step_cost_us": round(per_step, 2),
            "armed_step_share_pct": round(100 * per_step / step_us, 4),
            "amortized_share_pct": round(100 * per_step / step_us / run_steps, 6), "run_steps": run_steps}


def gpt2_small_optimizer() -> torch.optim.Optimizer:
    """GPT-2 small's parameters (nanoGPT's ``GPT``: 12 layers, 768 wide, 1024 positions, the head tied
    to the token embedding) in nanoGPT's ``configure_optimizers`` groups: matrices decayed, the rest not."""
    def param(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.empty(*shape))  # the values do not matter, only what the digest reads

    d = 768
    params = [param(50257, d), param(1024, d)]
    for _ in range(12):
        params += [param(d), param(d), param(3 * d, d), param(3 * d), param(d, d), param(d),
                   param(d), param(d), param(4 * d, d), param(4 * d), param(d, 4 * d), param(d)]
    params += [param(d), param(d)]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=6e-4)


def model_fingerprint(rounds: int) -> dict[str, Any]:
    """CPU time of the model record at a process's first step: the digest alone, and with the record's write."""
    opt = gpt2_small_optimizer()
    fields = steps.fingerprint(opt)
    results: dict[str, Any] = {"params": fields["params"], "tensors": fields["tensors"], "rounds": rounds}
    for name, call in (("digest", steps.fingerprint), ("record", steps.report_model)):
        call(opt)  # warm up
        times = []
        for _ in range(rounds):
            start = time.process_time()
            call(opt)
            times.append(time.process_time() - start)
        median, q1, q3 = spread(times)
        results[f"{name}_us"] = round(median * 1e6, 1)
        results[f"{name}_iqr_us"] = [round(q1 * 1e6, 1), round(q3 * 1e6, 1)]
    return results


def startup(rounds: int, events: str) -> dict[str, Any]:
    # Bytecode as an installed package has it (a first run writes it): not a compile in every start.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    probed_env = {**env, "PYTHONPATH": SITE_DIR, "OOMGUARD_EVENTS": events}
    subprocess.run([sys.executable, "-c", "pass"], env=probed_env, check=True)
    bare, probed = [], []
    for _ in range(rounds):
        for times, with_env in ((bare, env), (probed, probed_env)):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], env=with_env, check=True)
            times.append(time.perf_counter() - start)
    return {"bare_ms": round(statistics.median(bare) * 1e3, 2), "probed_ms": round(statistics.median(probed) * 1e3, 2),
            "sitecustomize_ms": round(statistics.median(sitecustomize_import(probed_env) for _ in range(rounds)), 3),
            "rounds": rounds}


def sitecustomize_import(env: dict[str, str]) -> float:
    """Milliseconds Python spent importing the probe's sitecustomize (-X importtime, cumulative):
    the whole cost in a process that never imports torch, without the noise of a process start."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env, capture_output=True,
                         text=True, check=True)
    rows = [row for row in (line.split("|") for line in out.stderr.splitlines()) if row[-1].strip() == "sitecustomize"]
    return max(int(row[1]) for row in rows) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=1000, help="steps of the tiny linear model a round")
    p.add_argument("--example-steps", type=int, default=50, help="steps of the example's model a round")
    p.add_argument("--startup-rounds", type=int, default=20)
    p.add_argument("--startup-only", action="store_true", help="only the interpreter's start-up")
    p.add_argument("--forward-only", action="store_true", help="only the forward tracker")
    p.add_argument("--model-only", action="store_true", help="only the model record (GPT-2 small's parameters)")
    p.add_argument("--run-steps", type=int, default=1000,
                   help="optimizer steps of a run, to amortize the tracker's first step over")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OOMGUARD_EVENTS"] = str(Path(tmp) / "events.jsonl")  # the records are written, as in a run
        torch.set_num_threads(1)
        result: dict[str, Any] = {}
        if args.model_only:
            print(json.dumps({"model_record_gpt2_small": model_fingerprint(args.rounds)}, indent=2))
            return
        if args.forward_only:
            step_us = step_time(*nanogpt_style(), args.example_steps) * 1e6
            result["forward_tracker_smallest_example"] = forward_tracker(nanogpt_style, step_us, args.rounds,
                                                                         args.run_steps)
            print(json.dumps(result, indent=2))
            return
        if not args.startup_only:
            result["smallest_example_step"] = optimizer_steps(nanogpt_style, args.rounds, args.example_steps)
            result["tiny_linear_step"] = optimizer_steps(tiny_linear, args.rounds, args.steps)
            for name, make in (("smallest_example", nanogpt_style), ("tiny_linear", tiny_linear)):
                step_us = result[f"{name}_step"]["step_us"]
                result[f"forward_tracker_{name}"] = forward_tracker(make, step_us, args.rounds, args.run_steps)
            result["model_record_gpt2_small"] = model_fingerprint(args.rounds)
        result["interpreter_startup"] = startup(args.startup_rounds, os.environ["OOMGUARD_EVENTS"])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
