"""The worker's in-process recovery from a real CUDA OOM, on a machine with a GPU.

``torch.cuda.set_per_process_memory_fraction`` caps this process's CUDA caching allocator, so a
large micro-batch fails with a genuine ``torch.OutOfMemoryError``. The check then:

1. trains an MLP through the session starting at a micro-batch that cannot fit, and shows it
   settles on one that does, with the same global batch;
2. provokes ``--repeats`` OOMs in a row (each a whole failed attempt at a size too large) and
   shows ``torch.cuda.memory_allocated`` back at its baseline after each;
3. prints a JSON summary for the closing note. Exits 0 when every check holds, 2 without a GPU.

    .venv/bin/python scripts/gpu_check_worker.py --repeats 10

The cap is sized from the GPU it finds: the fixed memory (weights, gradients, optimizer state) and
the memory per sample are measured with one uncapped step first, then the cap leaves room for
about a third of the global batch, so the full batch fails and a smaller micro-batch fits on any
GPU from 16 GB to 140 GB.
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


def per_sample_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, width: int, probe: int) -> tuple[int, int]:
    """(bytes in use with the optimizer's state made, bytes per sample of a training step), measured
    with one uncapped step at ``probe`` samples before the cap is set."""
    x = torch.randn(probe, width, device="cuda")
    y = torch.randint(0, 10, (probe,), device="cuda")
    loss_fn(model, (x, y)).backward()
    optimizer.step()  # AdamW's state exists from here on: part of the fixed memory
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    fixed = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss_fn(model, (x, y)).backward()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return fixed, max(1, (torch.cuda.max_memory_allocated() - fixed) // probe)


def cap_fraction(fixed: int, per_sample: int, global_batch: int, total: int) -> float | None:
    """The memory fraction that fits ``fixed`` plus a third of the batch (with the allocator's
    slack), or None when that is more than the device has."""
    cap = fixed + per_sample * global_batch // 3 + 256 * 2**20
    return cap / total if cap < 0.9 * total else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fraction", type=float, default=None,
                   help="share of GPU memory this process may use (default: sized from the GPU so that "
                        "about a third of the global batch fits)")
    p.add_argument("--global-batch", type=int, default=4096)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(0).total_memory
    model, optimizer = build(args.width, args.depth)
    fixed, per_sample = per_sample_bytes(model, optimizer, args.width, probe=64)
    fraction = args.fraction if args.fraction is not None else cap_fraction(fixed, per_sample, args.global_batch, total)
    if fraction is None:
        print(f"this GPU ({total / 2**30:.1f} GiB) cannot hold a third of the batch: lower --global-batch",
              file=sys.stderr)
        return 2
    torch.cuda.set_per_process_memory_fraction(fraction)
    session = Session(model, optimizer, loss_fn, SessionConfig(global_batch=args.global_batch, grow_after=5))
    x = torch.randn(args.global_batch, args.width, device="cuda")
    y = torch.randint(0, 10, (args.global_batch,), device="cuda")

    results = [session.step((x, y)) for _ in range(args.steps)]
    settled = session.micro_batch
    print(
        f"cap {fraction * total / 2**30:.2f} GiB (fixed {fixed / 2**30:.2f} GiB, {per_sample / 2**20:.2f} MiB "
        f"per sample); settled at micro-batch {settled} after {sum(r.ooms for r in results)} OOMs; "
        f"steps {results[-1].step}",
        file=sys.stderr,
    )

    baseline = torch.cuda.memory_allocated()
    after: list[int] = []
    repeat_ooms: list[int] = []
    for _ in range(args.repeats):
        session.tuner.current, session.tuner.trial = args.global_batch, False
        session.tuner.failed.discard(args.global_batch)
        ooms = session.step((x, y)).ooms
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
        repeat_ooms.append(ooms)
    summary = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "total_bytes": total,
        "cap_bytes": int(fraction * total),
        "fixed_bytes": fixed,
        "per_sample_bytes": per_sample,
        "ooms_per_repeat": repeat_ooms,
        "settled_micro_batch": settled,
        "ooms_first_steps": sum(r.ooms for r in results),
        "baseline_allocated": baseline,
        "allocated_after_each_oom": after,
        "leak_bytes": max(after) - baseline,
        "steps": session.step_count,
    }
    print(json.dumps(summary, indent=2))
    ok = settled < args.global_batch and max(after) <= baseline and min(repeat_ooms) >= 1
    print("OK" if ok else "FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
