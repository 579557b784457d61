"""A DDP training script for the lost-node tests (Gloo on CPU): it keeps its own record of every
optimizer step, so the test judges the global batch by what the ranks really trained on.

Each optimizer step, every rank counts the samples it ran through forward and backward (micro-batch
by micro-batch), the counts are all-reduced, and rank 0 appends one JSON line to ``--records``:
the step, the world, the plan and the samples of that step over every rank. Rank 0 saves a
checkpoint after every step (atomically: a directory renamed into place). The run ends at
``--steps``, or after the step on which ``--until`` exists (the test says when it has seen enough).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--gradient-accumulation-steps", type=int, required=True)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--step-sleep", type=float, default=0.2)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--records", type=Path, required=True)
    p.add_argument("--until", type=Path, required=True)
    p.add_argument("--resume-from", type=Path)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum = args.micro_batch_size, args.gradient_accumulation_steps
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if args.resume_from is not None:
        state = torch.load(args.resume_from / "state.pt")
        model.module.load_state_dict(state["model"])
        step = state["step"]
    print(f"rank {rank} world {world} micro {micro} accum {accum} start_step {step}", flush=True)
    while step < args.steps:
        step += 1
        samples = train_step(model, opt, step, rank, micro, accum)
        counts = torch.tensor([samples, int(args.until.exists())])
        dist.all_reduce(counts)
        if rank == 0:
            save(args.ckpt_dir, step, model.module.state_dict())
            record(args.records, {"step": step, "world": world, "micro": micro, "accum": accum,
                                  "samples": int(counts[0]), "node": os.environ.get("OOMGUARD_NODE_RANK"),
                                  "attempt": os.environ.get("OOMGUARD_ATTEMPT"), "t": time.time()})
        time.sleep(args.step_sleep)
        if counts[1] > 0:
            break
    print(f"rank {rank} finished step {step}", flush=True)
    dist.destroy_process_group()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, micro: int,
               accum: int) -> int:
    """One optimizer step of ``accum`` micro-batches; the samples it trained on."""
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    opt.zero_grad()
    samples = 0
    for _ in range(accum):
        x, y = torch.randn(micro, 8, generator=gen), torch.randn(micro, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y) / accum
        loss.backward()
        samples += len(x)
    opt.step()
    return samples


def save(ckpt_dir: Path, step: int, model: dict[str, torch.Tensor]) -> None:
    tmp = ckpt_dir / f".tmp-step-{step}"
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "step": step}, tmp / "state.pt")
    os.replace(tmp, ckpt_dir / f"step-{step}")


def record(path: Path, line: dict[str, object]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
