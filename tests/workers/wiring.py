"""An argparse training script as new users write them, for the wiring mistakes (tests/e2e/test_wiring.py).

It saves ``OUTPUT/step-N.pt`` every ``--save-every`` steps (written to a temp name, then renamed),
resumes with ``--resume PATH``, and, like many scripts, ignores arguments it does not know (a
mistyped resume flag passes without a word). At ``--long-step`` it allocates ``--mb-per-sample``
MiB per sample of the micro-batch under an address-space budget (RLIMIT_AS), so a micro-batch too
large fails in PyTorch's real CPU allocator (``DefaultCPUAllocator: can't allocate memory``).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--output", type=Path, default=Path("out"))
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--long-step", type=int, default=8)
    p.add_argument("--mb-per-sample", type=int, default=8)
    p.add_argument("--budget-mb", type=int, default=200)
    p.add_argument("--step-seconds", type=float, default=0.2)
    args, unknown = p.parse_known_args()
    if unknown:
        print(f"ignoring unknown arguments: {' '.join(unknown)}", flush=True)
    return args


def limit_memory(budget_mb: int) -> None:
    """The address space in use now plus the budget: allocations past it fail for real."""
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + budget_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def save(out: Path, step: int, weights: torch.Tensor) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".step-{step}.pt.tmp"
    torch.save({"step": step, "weights": weights}, tmp)
    os.replace(tmp, out / f"step-{step}.pt")
    print(f"saved {out / f'step-{step}.pt'}", flush=True)


def main() -> None:
    args = parse()
    weights = torch.zeros(1024)
    start = 0
    if args.resume is not None:
        state = torch.load(args.resume)
        weights, start = state["weights"], state["step"]
        print(f"resumed from {args.resume} at step {start}", flush=True)
    limit_memory(args.budget_mb)
    for step in range(start + 1, args.steps + 1):
        if step == args.long_step:  # a long batch: memory per sample, for real
            held = torch.ones(args.batch_size * args.mb_per_sample * 2**18)
            weights += held[:1024]
            del held
        weights += 1.0
        time.sleep(args.step_seconds)
        print(f"step {step}/{args.steps} loss {1.0 / step:.4f}", flush=True)
        if step % args.save_every == 0:
            save(args.output, step, weights)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
