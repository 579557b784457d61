"""A script that names its checkpoints ``ckpt_step{step}_bs{batch}.pt``, as users do: after
oomguard halves the batch, the newer checkpoint has the smaller last number
(``ckpt_step200_bs16.pt`` beside ``ckpt_step100_bs32.pt``). With ``--name batches`` it names them
as accelerate's examples do, ``step_{overall_step}.pt``, a count of micro-batches: ``grad_accum``
times the optimizer's steps.

Each attempt takes ``--steps`` real Adam steps on a tiny model (the probe counts them), saves with
``torch.save`` straight to the final name (the probe's save record names the file), and at a
micro-batch above ``--fail-above`` ends in a CUDA OOM after its save; at or below it, it finishes.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--resume-from", type=Path)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--fail-above", type=int, default=8)
    p.add_argument("--name", choices=["bs", "batches"], default="bs")
    args = p.parse_args()
    micro, accum = int(os.environ["OOMGUARD_MICRO_BATCH"]), int(os.environ["OOMGUARD_GRAD_ACCUM"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = batches = 0
    if args.resume_from is not None:
        state = torch.load(args.resume_from)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, batches = state["step"], state["batches"]
        print(f"resumed from {args.resume_from.name} step {step}", flush=True)
    for _ in range(args.steps):
        optimizer.zero_grad()
        for _ in range(accum):
            (model(torch.randn(micro, 4)).pow(2).mean() / accum).backward()
            batches += 1
        optimizer.step()
        step += 1
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"ckpt_step{step}_bs{micro}.pt" if args.name == "bs" else f"step_{batches}.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "batches": batches},
               args.ckpt_dir / name)
    print(f"saved step {step} at micro-batch {micro}", flush=True)
    if micro > args.fail_above:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of "
            "which 1.02 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and "
            "512.00 MiB is reserved by PyTorch but unallocated.")


if __name__ == "__main__":
    main()
