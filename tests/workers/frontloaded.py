"""A plain training script whose forward spends most of its memory in its first layers, under a real
address-space budget: what ``--predict-shrink`` extrapolates too far from, and ``--grow`` climbs back.

Once its model and optimizer are built, before it loads a checkpoint, it caps its own address space
(RLIMIT_AS) at what it maps then plus ``BUDGET_MB`` (bench/peerkit/workload.py caps at the first
forward instead, which gives a resumed attempt its loaded optimizer state on top of the budget), so a
micro-batch too large fails in PyTorch's real ``DefaultCPUAllocator``, fresh or resumed alike.
The model is one wide layer (most of the activations) and then many narrow ones: an OOM early in
the forward has run few of its leaf modules but most of its memory, so a prediction from the share
of modules run over-estimates the per-sample need (it goes too far).
Each optimizer step prints the samples it trained on, so a test checks the global batch.

    python frontloaded.py --batch-size 8 --gradient-accumulation-steps 8 --steps 6 --output ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_argparse import save  # checkpoint-N written to a temp dir and renamed, as the example does


def cap() -> None:
    budget = int(os.environ.get("BUDGET_MB", "0")) * 2**20
    if budget <= 0:
        return
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class FrontLoaded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 64))
        self.narrow = nn.Sequential(*(layer for _ in range(3) for layer in (nn.Linear(64, 64), nn.Tanh())))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.narrow(self.wide(x))).pow(2).mean()


def batch(step: int, size: int) -> torch.Tensor:
    return torch.randn(size, 64, 64, generator=torch.Generator().manual_seed(step))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--resume-from", type=Path, default=None)
    p.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step (a longer run)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False  # every allocation through DefaultCPUAllocator (a real CPU OOM)
    torch.manual_seed(0)
    model = FrontLoaded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    cap()
    if args.resume_from:
        state = torch.load(args.resume_from / "state.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = json.loads((args.resume_from / "trainer_state.json").read_text())["step"]
    size = args.batch_size * args.gradient_accumulation_steps
    for step in range(start, args.steps):
        opt.zero_grad(set_to_none=True)
        samples = 0
        for chunk in batch(step, size).split(args.batch_size):
            (model(chunk) * (chunk.shape[0] / size)).backward()
            samples += chunk.shape[0]
        opt.step()
        time.sleep(args.pace)
        print(f"step {step + 1}/{args.steps} samples {samples} micro-batch {args.batch_size}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save(args.output, step + 1, model, opt)


if __name__ == "__main__":
    main()
