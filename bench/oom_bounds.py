"""How often does a failed attempt's own memory reading prove a smaller size cannot fit?

After an OOM at micro-batch ``f`` the allocator's figures are a lower bound of what ``f`` needs:
it held ``allocated`` and asked ``requested`` more under the limit. Scaled down to a smaller ``m``
(every tensor past the fixed memory has the batch dimension), ``fixed + (allocated + requested -
fixed) * m / f`` is a lower bound of what ``m`` needs at the same point of the program: when it is
above the limit, ``m`` cannot fit and the supervisor skips it (``memmodel.OomFigures``, ``unfit``).
This script measures how often that happens on the benchmark's workload (bench/peerkit/workload.py,
the model of bench/peers.py): for each memory budget, each divisor of the batch that fails is
tried once under a real RLIMIT_AS (PyTorch's ``DefaultCPUAllocator`` really fails), and the bound
is applied to the next halving (what oomguard tries next) and to ``int(0.9 f)`` (the step HF
Trainer and Accelerate take).

    python bench/oom_bounds.py                 # about a minute on 2 loaded cores

On CPU ``allocated`` is the process's address space when the exception is caught (the failed
step's tensors are still referenced by the traceback) and ``fixed`` its address space before the
first forward; on CUDA the in-process probe's ``oom`` record gives both exactly.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import resource
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "peerkit"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import workload

from oomguard.supervisor.sizing.memmodel import OomFigures

REQUESTED = re.compile(r"allocate (\d+) bytes")


def vm_size() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))


def attempt(model: torch.nn.Module, opt: torch.optim.Optimizer, micro: int, budget: int) -> OomFigures | None:
    """One training step at ``micro`` under ``budget`` bytes more than now; its figures if it failed."""
    gc.collect()
    fixed = vm_size()
    limit = fixed + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))  # the soft limit can be lifted again
    try:
        opt.zero_grad(set_to_none=True)
        model(workload.global_batch(0, micro))["loss"].backward()
        opt.step()
        return None
    except RuntimeError as exc:
        found = REQUESTED.search(str(exc))
        if found is None:
            raise
        return OomFigures(micro, int(found.group(1)), vm_size(), limit, fixed)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        opt.zero_grad(set_to_none=True)


def measure(batch: int, budgets_mb: list[int]) -> list[dict[str, Any]]:
    workload.setup()
    model = workload.TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    attempt(model, opt, 1, 2**40)  # the optimizer's state and the allocator's first pages, before any cap
    sizes = [d for d in range(batch, 0, -1) if batch % d == 0]
    rows = []
    for mb in budgets_mb:
        for f in sizes:
            figures = attempt(model, opt, f, mb * 2**20)
            if figures is None:
                break  # it fits; so does every smaller size
            half, tenth = f // 2, int(0.9 * f)
            rows.append({"budget_mb": mb, "failed": f, "requested_mb": round(figures.requested_bytes / 2**20, 1),
                         "room_mb": round((figures.limit_bytes - figures.fixed_bytes) / 2**20, 1),
                         "proves_half": bool(half) and figures.proves_unfit(half),
                         "proves_0.9": bool(tenth) and tenth < f and figures.proves_unfit(tenth),
                         "proven_below": [m for m in sizes if m < f and figures.proves_unfit(m)]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--budgets-mb", type=int, nargs="+", default=[40, 60, 90, 120, 180, 240, 320])
    args = p.parse_args()
    rows = measure(args.batch, args.budgets_mb)
    half = sum(r["proves_half"] for r in rows)
    tenth = sum(r["proves_0.9"] for r in rows)
    print(f"{len(rows)} OOMs over budgets {args.budgets_mb} MB: the failed attempt's figures proved the next halving "
          f"cannot fit in {half} ({half / max(len(rows), 1):.0%}), int(0.9 x size) in {tenth} "
          f"({tenth / max(len(rows), 1):.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
