"""A small training loop whose memory the test knows exactly, for the memory breakdown (issue 38).

``python breakdown.py KIND MICRO STEPS FIGURES [--workers N]``: KIND is ``adamw``, ``sgd`` (momentum)
or ``frozen`` (the first layers frozen, AdamW on the rest: a LoRA's shape). Each step's forward keeps
MICRO × 16 MiB of activations (one 16 MiB tensor a sample) until the backward; after the first step
the script writes what it computes itself to FIGURES (JSON): its parameters', frozen parameters',
gradients' and optimizer state's bytes. Under ``prlimit --as`` a micro-batch too large fails in
PyTorch's CPU allocator (``DefaultCPUAllocator: can't allocate memory``). ``--grow MIB`` instead
keeps MIB more each step (a host leak) until a memory cgroup's limit has the kernel kill it, with a
DataLoader worker beside it (``--workers``). ``--cuda-limit-mib N`` trains on CUDA under a per-process
memory fraction of N MiB (a real CUDA OOM), ``--sample-mib`` sets a sample's activations.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

MIB = 2**20


def model_and_optimizer(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    if kind == "frozen":
        for layer in list(model)[:3]:
            layer.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return model, torch.optim.SGD(trainable, lr=0.01, momentum=0.9)
    return model, torch.optim.AdamW(trainable, lr=0.001)


def own_figures(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    return {"weights": sum(size(p) for p in model.parameters()),
            "frozen_weights": sum(size(p) for p in model.parameters() if not p.requires_grad),
            "gradients": sum(size(p.grad) for p in model.parameters() if p.grad is not None),
            "optimizer_state": sum(size(v) for s in opt.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind")
    parser.add_argument("micro", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("figures")
    parser.add_argument("--grow", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--cuda-limit-mib", type=int, default=0)  # on CUDA, under this per-process cap
    parser.add_argument("--sample-mib", type=int, default=16)
    parser.add_argument("--accum", type=int, default=1)  # oomguard's {grad_accum}: the memory does not follow it
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if args.cuda_limit_mib else "cpu"
    if args.cuda_limit_mib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cuda_limit_mib * MIB / total)
    model, opt = model_and_optimizer(args.kind)
    model.to(device)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4096, 256)), batch_size=4,
                                       num_workers=args.workers)
    batches = iter(data)  # one iterator: its DataLoader workers live as long as the run
    kept = []
    for step in range(1, args.steps + 1):
        (x,) = next(batches)
        x = x.to(device)
        # The batch's activations, freed after the step; the first step takes one sample (a warm-up), so an OOM
        # comes in the second, when the gradients and the optimizer's state exist.
        acts = [torch.ones(args.sample_mib * MIB // 4, device=device) for _ in range(args.micro if step > 1 else 1)]
        loss = model(x).sum() + sum(a[0] for a in acts)
        loss.backward()
        opt.step()
        if step == 1:
            with open(args.figures, "w") as f:
                json.dump(own_figures(model, opt), f)
        opt.zero_grad(set_to_none=False)  # the gradients stay allocated: the OOM's breakdown counts them
        del acts, loss
        if args.grow:
            kept.append(torch.ones(int(args.grow * MIB) // 4))
        print(f"step {step}", flush=True)
        time.sleep(0.02)
    print(f"done micro={args.micro} steps={args.steps}", flush=True)


if __name__ == "__main__":
    main()
