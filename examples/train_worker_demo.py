"""A small real training run through oomguard's worker library.

A token-wise MLP classifier (a transformer block without attention) learns a random teacher on
synthetic data generated from a seed. ``--memory-budget-mb`` caps the address space
(``RLIMIT_AS``) at its size after start-up plus the budget, so a micro-batch whose activations do
not fit fails in PyTorch's real host allocator (``DefaultCPUAllocator: can't allocate memory``),
exactly as a GPU run fails in the CUDA allocator. The session absorbs it and retries the same
global batch smaller; under ``oomguard run`` the supervisor is told about every change.

    python examples/train_worker_demo.py --global-batch 128 --micro-batch 128 --memory-budget-mb 120
    oomguard run --run-dir runs/demo --global-batch 128 --micro-batch 128 \
        --checkpoint 'runs/demo/ckpt/checkpoint-*' -- \
        python examples/train_worker_demo.py --checkpoint-dir runs/demo/ckpt --memory-budget-mb 120
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oomguard import Session, SessionConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in the whole run")
    p.add_argument("--global-batch", type=int, default=None, help="default: the supervisor's, else 128")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the supervisor's, else the batch")
    p.add_argument("--dataset-size", type=int, default=8192)
    p.add_argument("--seq", type=int, default=32, help="tokens per sample")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256, help="MLP width: the activation memory per sample")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--resume-from", default=None, help="a checkpoint directory (default: the newest)")
    p.add_argument("--no-inprocess", action="store_true", help="leave every OOM to the supervisor")
    p.add_argument("--grow-after", type=int, default=20, help="stable steps before growing (0: never)")
    p.add_argument("--memory-budget-mb", type=float, default=None, help="address space after start-up")
    p.add_argument("--squeeze-at-step", type=int, default=None, help="from this step on, the budget is...")
    p.add_argument("--squeeze-budget-mb", type=float, default=None, help="...this many MiB")
    p.add_argument("--relax-at-step", type=int, default=None, help="from this step on, the first budget")
    p.add_argument(
        "--log-samples", default=None, help="append each step's start time and sample ids (JSON lines)"
    )
    p.add_argument("--save-weights", default=None, help="write the final weights here (torch.save)")
    return p.parse_args(argv)


class SyntheticTokens(torch.utils.data.Dataset[tuple[int, torch.Tensor, int]]):
    """Sample i is a (seq, width) Gaussian drawn from seed and i; its label comes from a fixed teacher."""

    def __init__(self, size: int, seq: int, width: int, seed: int, classes: int = 10) -> None:
        self.size, self.seq, self.width, self.seed = size, seq, width, seed
        self.teacher = torch.randn(width, classes, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x = torch.randn(self.seq, self.width, generator=generator)
        label = int((torch.tanh(x).mean(0) @ self.teacher).argmax())
        return index, x, label


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class TokenMLP(nn.Module):
    def __init__(self, width: int, hidden: int, layers: int, dropout: float, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width, hidden, dropout) for _ in range(layers)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=1))


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """The mean loss over one micro-batch; the session weights it by the micro-batch's share."""
    _, x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


class AddressSpaceBudget:
    """RLIMIT_AS = the address space in use at start-up + a budget; the budget can change later."""

    def __init__(self) -> None:
        # Make glibc's address-space use follow the tensors in use, so the budget means what it
        # says: one arena (each thread's own arena reserves 64 MiB of address space holding
        # nothing), and a fixed mmap threshold (the adaptive one moves freed tensor-sized blocks
        # to the heap, whose top fragments and never shrinks).
        libc = ctypes.util.find_library("c")
        if libc:
            ctypes.CDLL(libc).mallopt(-8, 1)  # M_ARENA_MAX
            ctypes.CDLL(libc).mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        self.base = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()

    def set(self, budget_mb: float) -> None:
        limit = self.base + int(budget_mb * 2**20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = SyntheticTokens(args.dataset_size, args.seq, args.width, args.seed)
    model = TokenMLP(args.width, args.hidden, args.layers, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    config = SessionConfig(
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        total_steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_last=args.keep_last,
        async_save=args.async_save,
        recover_in_process=not args.no_inprocess,
        grow_after=args.grow_after or None,
        seed=args.seed,
        progress_every_s=0.0,
        fingerprint_extra=json.dumps([args.width, args.hidden, args.layers, args.dataset_size, args.seq]),
    )
    if config.global_batch is None and not _supervised():
        config = SessionConfig(**{**config.__dict__, "global_batch": 128})
    session = Session(model, optimizer, loss_fn, config, scheduler=scheduler)
    budget = _budget(args)  # after the model exists: the budget is for training memory
    with session:
        if args.resume_from:
            session.resume(args.resume_from)
        print(f"start at step {session.step_count}, micro-batch {session.micro_batch}", file=sys.stderr)
        began = time.monotonic()
        for batch in session.batches(dataset):
            _apply_budget(args, budget, session.step_count)
            # Logged before the step: the step may end with a checkpoint, after which it is done.
            _log_samples(args.log_samples, session.step_count + 1, batch[0])
            result = session.step(batch)
            if result.ooms or result.step % 10 == 0:
                print(
                    f"step {result.step:4d}  loss {result.loss:.4f}  micro-batch {result.micro_batch:3d} "
                    f"x {result.grad_accum}  ooms absorbed {result.ooms}",
                    file=sys.stderr,
                )
        if budget is not None:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(f"done: {session.step_count} steps in {time.monotonic() - began:.1f}s", file=sys.stderr)
    if args.save_weights:
        torch.save(model.state_dict(), args.save_weights)
    return 0


def _supervised() -> bool:
    import os

    return bool(os.environ.get("OOMGUARD_GLOBAL_BATCH"))


def _budget(args: argparse.Namespace) -> AddressSpaceBudget | None:
    if args.memory_budget_mb is None:
        return None
    torch.ones(64, 64) @ torch.ones(64, 64)  # start torch's thread pool before the cap
    budget = AddressSpaceBudget()
    budget.set(args.memory_budget_mb)
    return budget


def _apply_budget(args: argparse.Namespace, budget: AddressSpaceBudget | None, step: int) -> None:
    """The memory pressure schedule: a squeeze from one step (another tenant arrives), a relax later."""
    if budget is None:
        return
    squeezed = args.squeeze_at_step is not None and step >= args.squeeze_at_step
    relaxed = args.relax_at_step is not None and step >= args.relax_at_step
    if squeezed and not relaxed and args.squeeze_budget_mb is not None:
        budget.set(args.squeeze_budget_mb)
    else:
        budget.set(args.memory_budget_mb)


def _log_samples(path: str | None, step: int, ids: torch.Tensor) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "t": time.time(), "ids": ids.tolist()}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
