"""How long training stalls for a checkpoint: synchronous save vs. asynchronous save.

A 6 x 2048 x 2048 MLP (25 M parameters; with AdamW's two moments a ~300 MB checkpoint) trains
through the worker session and checkpoints every ``--every`` steps. The stall of a save is the
duration of the step that saved minus the median of the steps that did not. Asynchronous save
only copies the state to CPU memory in the step; a background thread writes and fsyncs.

    .venv/bin/python bench/checkpoint_stall.py --saves 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from oomguard import Session, SessionConfig  # noqa: E402


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def run(async_save: bool, args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    layers = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    work = Path(tempfile.mkdtemp(prefix="oomguard-stall-"))
    steps = args.every * args.saves + args.every
    config = SessionConfig(
        global_batch=8, checkpoint_dir=str(work), checkpoint_every=args.every, keep_last=2,
        async_save=async_save, grow_after=None, resume=False,
    )  # fmt: skip
    x, y = torch.randn(8, args.width), torch.randn(8, args.width)
    durations: list[tuple[int, float]] = []
    began_all = time.perf_counter()
    try:
        with Session(model, optimizer, loss_fn, config) as session:
            for _ in range(steps):
                began = time.perf_counter()
                result = session.step((x, y))
                durations.append((result.step, time.perf_counter() - began))
        total = time.perf_counter() - began_all
        # The first save's step also pays for AdamW's state allocation: skip the first interval.
        saving = [d for s, d in durations if s % args.every == 0 and s > args.every]
        normal = statistics.median(d for s, d in durations if s % args.every and s > 2)
        stalls = [d - normal for d in saving]
        size = sum(f.stat().st_size for f in work.rglob("*") if f.is_file()) / 2 ** (20) / 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stall = statistics.median(stalls)
    return {"normal_step_s": normal, "stall_median_s": stall, "checkpoint_mb": size, "total_s": total}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {"sync": run(False, args), "async": run(True, args)}
    for mode, row in results.items():
        print(
            f"{mode:5s}  checkpoint {row['checkpoint_mb']:4.0f} MB"
            f"   normal step {row['normal_step_s'] * 1000:6.1f} ms"
            f"   stall per save (median) {row['stall_median_s'] * 1000:7.1f} ms"
            f"   whole run {row['total_s']:5.1f} s"
        )
    ratio = results["sync"]["stall_median_s"] / max(results["async"]["stall_median_s"], 1e-9)
    print(f"async stalls {ratio:.1f}x less")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
