"""A Hugging Face Accelerate training script, started by ``accelerate launch`` as its docs show.

``Accelerator(gradient_accumulation_steps=...)`` and ``accelerator.accumulate(model)`` do the
accumulation, ``save_state``/``load_state`` the checkpoints (``out/step_N``), and the batch is per
process: the global batch is ``--batch_size × --gradient_accumulation_steps × num_processes``, which
oomguard reads from ``accelerate launch``. Synthetic token data whose sequences grow at some
steps, as real corpora do; with ``--memory_budget_mb`` one process (``--budget_process``, default
the last) gets a host memory budget (RLIMIT_AS) after the first step: a micro-batch too large for a
long step then fails in PyTorch's real allocator on that process only.

    oomguard run --micro-batch 16 --global-batch 64 --checkpoint 'out/step_*' \\
        --resume-args '--resume_from_checkpoint {checkpoint}' -- \\
        accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py \\
        --batch_size {micro_batch} --gradient_accumulation_steps {grad_accum} --memory_budget_mb 340

(on CPU, with ``ACCELERATE_USE_CPU=1`` in the environment: Gloo instead of NCCL.) A long step takes about
480 MB of address space more than the process held when its budget was set at micro-batch 16, and 240 MB
at 8 (VmPeak less that VmSize, measured here), so 340 MB fails at 16 and fits at 8 by 100 MB or more:
before the budget is set a process maps and releases some 50 MB, and where that is still held at the
moment the budget is set, it is free to use after. A budget within that of either need (as 185 MB with
sequences of 1024, where 16 needs 240 MB) sometimes decides the other way.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch_size", type=int, default=8, help="micro-batch per process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--output_dir", type=Path, default=Path("out"))
    p.add_argument("--resume_from_checkpoint", type=Path, default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save_every", type=int, default=2)
    p.add_argument("--long_every", type=int, default=5, help="every Nth step has long sequences")
    p.add_argument("--long_seq", type=int, default=2048, help="their length (the others: 32)")
    p.add_argument("--memory_budget_mb", type=int, default=0, help="host memory budget of one process (RLIMIT_AS)")
    p.add_argument("--budget_process", type=int, default=-1, help="the process that gets the budget (-1: the last)")
    return p.parse_args()


class TokenMLP(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, hidden: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        logits = self.head(x + self.mlp(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def batch_for_step(step: int, size: int, long_every: int, long_seq: int) -> torch.Tensor:
    """The step's global batch, the same whatever the micro-batch: generated from the step."""
    g = torch.Generator().manual_seed(step)
    seq = long_seq if step % long_every == long_every - 1 else 32
    return torch.randint(0, 512, (size, seq + 1), generator=g)


def limit_memory(budget_mb: int) -> None:
    """Allow the address space in use now plus the budget: allocations beyond it fail for real.
    Large blocks come from mmap and go back when freed (a fixed M_MMAP_THRESHOLD): glibc would
    otherwise keep freed blocks in a heap that never shrinks, and the budget would drift."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: the budget is only a demonstration
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + budget_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def save(accelerator: Accelerator, out: Path, step: int) -> None:
    """``step_N`` written to a temporary directory and renamed by the main process: never half there."""
    tmp, final = out / f".step_{step}.tmp", out / f"step_{step}"
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # each process writes its own part (its RNG state): all of them before the rename
    if accelerator.is_main_process:
        (tmp / "step.json").write_text(json.dumps({"step": step}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        print(f"saved {final}", flush=True)
    accelerator.wait_for_everyone()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TokenMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    start = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(str(args.resume_from_checkpoint))
        start = json.loads((args.resume_from_checkpoint / "step.json").read_text())["step"]
    rank, world = accelerator.process_index, accelerator.num_processes
    micro, accum = args.batch_size, args.gradient_accumulation_steps
    print(f"process {rank} of {world}: micro {micro} accum {accum} global {micro * accum * world} "
          f"start_step {start}", flush=True)
    per_process = micro * accum
    budgeted = rank == (args.budget_process % world)
    for step in range(start, args.steps):
        tokens = batch_for_step(step, per_process * world, args.long_every, args.long_seq)
        tokens = tokens[rank * per_process:][:per_process]  # this process's share
        for chunk in tokens.split(micro):
            with accelerator.accumulate(model):  # syncs and steps at the last micro-batch only
                accelerator.backward(model(chunk))
                optimizer.step()
                optimizer.zero_grad()
        if accelerator.is_main_process:
            print(f"step {step + 1}/{args.steps} seq {tokens.shape[1] - 1}", flush=True)
        if args.memory_budget_mb and budgeted and step == start:
            limit_memory(args.memory_budget_mb)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save(accelerator, args.output_dir, step + 1)
    accelerator.end_training()


if __name__ == "__main__":
    main()
