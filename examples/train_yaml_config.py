"""A script that reads its batch from a YAML config (``--config configs/x.yaml``), as many do.

oomguard sets the batch keys in a per-attempt copy of the file (``--edit``) and points ``--config``
at the copy. Checkpoints are ``OUTPUT/step_N.pt``; ``--resume PATH`` continues from one. With
``--memory-budget-mb`` the process gets a host memory budget (RLIMIT_AS) once step
``--budget-from-step`` is done: a micro-batch too large for it then fails in PyTorch's real allocator.

    oomguard run --micro-batch 16 --global-batch 32 --checkpoint 'out/step_*.pt' \\
        --resume-args '--resume {checkpoint}' \\
        --edit 'examples/configs/tiny.yaml:train.micro_batch_size={micro_batch}' \\
        --edit 'examples/configs/tiny.yaml:train.gradient_accumulation_steps={grad_accum}' -- \\
        python examples/train_yaml_config.py --config examples/configs/tiny.yaml --memory-budget-mb 75
"""

from __future__ import annotations

import argparse
import os
import resource
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.block = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.head = nn.Linear(32, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        logits = self.head(x + self.block(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def limit_memory(budget_mb: int) -> None:
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + budget_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--resume", type=Path)
    p.add_argument("--memory-budget-mb", type=int, default=0)
    p.add_argument("--budget-from-step", type=int, default=2)
    args = p.parse_args()
    cfg: dict[str, Any] = yaml.safe_load(args.config.read_text())
    model_cfg, train = cfg["model"], cfg["train"]
    micro, accum = train["micro_batch_size"], train["gradient_accumulation_steps"]
    out = Path(cfg["output_dir"])
    print(f"config {args.config}: micro-batch {micro} x accumulation {accum}", flush=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyLM(model_cfg["vocab"])
    opt = torch.optim.AdamW(model.parameters(), lr=train["lr"])
    start = 0
    if args.resume:
        state = torch.load(args.resume)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed from {args.resume} at step {start}", flush=True)
    for step in range(start, train["steps"]):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, model_cfg["vocab"], (micro * accum, model_cfg["seq_len"] + 1), generator=g)
        total = 0.0
        for chunk in tokens.split(micro):  # the same global batch whatever the micro-batch
            loss = model(chunk) / accum
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step + 1}/{train['steps']} loss {total:.4f}", flush=True)
        if (step + 1) % train["save_every"] == 0 or step + 1 == train["steps"]:
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / f".step_{step + 1}.pt.tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, out / f"step_{step + 1}.pt")
        if args.memory_budget_mb and step + 1 == args.budget_from_step:
            limit_memory(args.memory_budget_mb)


if __name__ == "__main__":
    main()
