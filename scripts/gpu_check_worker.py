"""The worker's in-process recovery from a real CUDA OOM, on a machine with a GPU.

``torch.cuda.set_per_process_memory_fraction`` caps this process's CUDA caching allocator, so a
large micro-batch fails with a genuine ``torch.OutOfMemoryError``. The check then:

1. trains an MLP through the session starting at a micro-batch that cannot fit, and shows it
   settles on one that does, with the same global batch;
2. provokes ``--repeats`` OOMs in a row (each a whole failed attempt at a size too large) and
   shows ``torch.cuda.memory_allocated`` back at its baseline after each;
3. prints a JSON summary for the closing note. Exits 0 when every check holds, 2 without a GPU.

    .venv/bin/python scripts/gpu_check_worker.py --fraction 0.05 --repeats 10
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oomguard import Session, SessionConfig


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def build(width: int, depth: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    model = nn.Sequential(*layers, nn.Linear(width, 10)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fraction", type=float, default=0.05, help="share of GPU memory this process may use")
    p.add_argument("--global-batch", type=int, default=4096)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here", file=sys.stderr)
        return 2
    torch.cuda.set_per_process_memory_fraction(args.fraction)
    total = torch.cuda.get_device_properties(0).total_memory
    model, optimizer = build(args.width, args.depth)
    session = Session(model, optimizer, loss_fn, SessionConfig(global_batch=args.global_batch, grow_after=5))
    x = torch.randn(args.global_batch, args.width, device="cuda")
    y = torch.randint(0, 10, (args.global_batch,), device="cuda")

    results = [session.step((x, y)) for _ in range(args.steps)]
    settled = session.micro_batch
    print(
        f"cap {args.fraction * total / 2**30:.2f} GiB; settled at micro-batch {settled} "
        f"after {sum(r.ooms for r in results)} OOMs; steps {results[-1].step}",
        file=sys.stderr,
    )

    baseline = torch.cuda.memory_allocated()
    after: list[int] = []
    for _ in range(args.repeats):
        session.tuner.current, session.tuner.trial = args.global_batch, False
        session.tuner.failed.discard(args.global_batch)
        ooms = session.step((x, y)).ooms
        assert ooms >= 1, "the full batch fitted: lower --fraction"
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    summary = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cap_bytes": int(args.fraction * total),
        "settled_micro_batch": settled,
        "ooms_first_steps": sum(r.ooms for r in results),
        "baseline_allocated": baseline,
        "allocated_after_each_oom": after,
        "leak_bytes": max(after) - baseline,
        "steps": session.step_count,
    }
    print(json.dumps(summary, indent=2))
    ok = settled < args.global_batch and max(after) <= baseline
    print("OK" if ok else "FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
