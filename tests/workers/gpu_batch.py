"""A nanoGPT-shaped training loop on CUDA whose memory follows its micro-batch, for the GPU tests.

Each sample holds ``1/--per-limit`` of the memory this process may use (the device's total, or its
share under ``--fraction``, set with ``torch.cuda.set_per_process_memory_fraction``), so with the
default 220 a micro-batch of 512 or 256 meets a real CUDA OOM in the caching allocator and 128 fits.
The script knows nothing of oomguard: it takes ``--batch_size``/``--gradient_accumulation_steps``
as nanoGPT does, rewrites ``out/ckpt.pt`` every ``--eval_interval`` iterations, resumes with
``--init_from=resume`` and prints nanoGPT's ``iter N: loss`` lines.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn


class Wide(nn.Module):
    """Activations of ``width`` floats per sample, kept for backward three times over."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x * self.scale)
        return (torch.tanh(h) * self.scale).square().mean()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, required=True)
    p.add_argument("--gradient_accumulation_steps", type=int, required=True)
    p.add_argument("--max_iters", type=int, default=12)
    p.add_argument("--eval_interval", type=int, default=4)
    p.add_argument("--out_dir", default="out")
    p.add_argument("--init_from", default="scratch")
    p.add_argument("--fraction", type=float, default=0.0)
    p.add_argument("--per-limit", type=int, default=220, dest="per_limit")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if args.fraction:
        torch.cuda.set_per_process_memory_fraction(args.fraction, device)
    limit = int(total * (args.fraction or 1.0))
    width = limit // args.per_limit // (3 * 4)  # three float32 activations per element
    model = Wide(width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out_dir = os.path.join(args.out_dir, f"rank{rank}")
    ckpt = os.path.join(out_dir, "ckpt.pt")
    iter_num = 0
    if args.init_from == "resume" and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        iter_num = state["iter_num"]
        print(f"Resuming training from {ckpt} at iter {iter_num}", flush=True)
    while iter_num < args.max_iters:
        if iter_num and iter_num % args.eval_interval == 0:
            os.makedirs(out_dir, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
            torch.save(state, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            print(f"saving checkpoint to {out_dir}", flush=True)
        for _ in range(args.gradient_accumulation_steps):
            x = torch.randn(args.batch_size, width, device=device)
            loss = model(x) / args.gradient_accumulation_steps
            loss.backward()
            del x
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {iter_num}: loss {loss.item():.4f}, time 1.00ms, mfu -100.00%", flush=True)
        iter_num += 1
    print(f"done micro={args.batch_size} accum={args.gradient_accumulation_steps}", flush=True)


if __name__ == "__main__":
    main()
