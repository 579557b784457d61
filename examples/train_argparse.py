"""A plain training script, the kind oomguard supervises without any change to it.

argparse flags as in the guides users write (``--batch-size``, ``--gradient-accumulation-steps``,
``--resume-from``), ``checkpoint-N/`` directories, synthetic token data whose sequence length grows
at some steps, as real corpora do. Run with ``--memory-budget-mb`` to give the process a host memory
budget (RLIMIT_AS): a micro-batch too large for a long batch then fails in PyTorch's real allocator
(``DefaultCPUAllocator: can't allocate memory``) mid-run, after checkpoints exist.

    oomguard run --micro-batch 32 --global-batch 64 --checkpoint 'out/checkpoint-*' \
        --resume-args '--resume-from {checkpoint}' -- \
        python examples/train_argparse.py --batch-size {micro_batch} \
        --gradient-accumulation-steps {grad_accum} --output out --memory-budget-mb 300
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
from pathlib import Path

import torch
from torch import nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--output", type=Path, default=Path("out"))
    p.add_argument("--resume-from", type=Path, default=None)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--long-every", type=int, default=5, help="every Nth step has long sequences")
    p.add_argument("--memory-budget-mb", type=int, default=0, help="host memory budget (RLIMIT_AS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="sgd keeps no step count in its state")
    return p.parse_args()


class TokenMLP(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, hidden: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + self.mlp(x))


def batch_for_step(step: int, size: int, long_every: int, seed: int) -> torch.Tensor:
    """The step's global batch, the same whatever the micro-batch: generated from (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    seq = 256 if step % long_every == long_every - 1 else 32
    return torch.randint(0, 512, (size, seq + 1), generator=g)


def save(out: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """checkpoint-N written to a temp directory and renamed, so a partial one never has the name."""
    final, tmp = out / f"checkpoint-{step}", out / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp / "state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
    if final.exists():  # the same step again after a resume: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    print(f"saved {final}", flush=True)


def limit_memory(budget_mb: int) -> None:
    """Allow the address space in use now plus the budget: allocations beyond it fail for real."""
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + budget_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = TokenMLP()
    opt: torch.optim.Optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if args.optimizer == "adamw"
                                  else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    start = 0
    if args.resume_from:
        state = torch.load(args.resume_from / "state.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = json.loads((args.resume_from / "trainer_state.json").read_text())["step"]
        print(f"resumed from {args.resume_from} at step {start}", flush=True)
    global_batch = args.batch_size * args.gradient_accumulation_steps
    print(f"micro-batch {args.batch_size} x accumulation {args.gradient_accumulation_steps} "
          f"= {global_batch}", flush=True)
    if args.memory_budget_mb:
        warm_up(model, batch_for_step(0, 1, 10**9, args.seed))
        limit_memory(args.memory_budget_mb)
    for step in range(start, args.steps):
        tokens = batch_for_step(step, global_batch, args.long_every, args.seed)
        loss = train_step(model, opt, tokens, args.batch_size)
        print(f"step {step + 1}/{args.steps} seq {tokens.shape[1] - 1} loss {loss:.4f}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save(args.output, step + 1, model, opt)


def warm_up(model: nn.Module, tokens: torch.Tensor) -> None:
    """Map the allocator's pools with one forward and backward pass, and no optimizer step: a step
    here would train on a batch that is no step's, on every start (a resume's too), and its count
    (the optimizer's, a supervisor's) would run ahead of the script's own step."""
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, micro: int) -> float:
    total = 0.0
    for chunk in tokens.split(micro):
        logits = model(chunk[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        loss = loss / tokens[:, 1:].numel()  # each micro-batch weighted by its share: exact accumulation
        loss.backward()
        total += loss.item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


if __name__ == "__main__":
    main()
