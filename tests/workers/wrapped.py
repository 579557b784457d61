"""A tiny torch training loop for the commands behind wrappers (``prlimit``, ``bash -c``), issue 35.

``python wrapped.py train MICRO ACCUM STEPS``: STEPS real optimizer steps (the probe counts them).
``python wrapped.py leak MICRO ACCUM``: each step allocates MICRO × 4 MiB and keeps 3 MiB, until the
address-space limit the command runs under (``prlimit --as``) makes PyTorch's CPU allocator fail.
``python wrapped.py idle``: imports torch and ends without a step.
"""

from __future__ import annotations

import sys
import time

import torch

MIB = 2**20


def main() -> None:
    mode = sys.argv[1]
    if mode == "idle":
        print("imported torch, no step", flush=True)
        return
    micro = int(sys.argv[2])
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    steps = int(sys.argv[4]) if mode == "train" else 10_000
    for step in range(1, steps + 1):
        batch = torch.ones(micro * MIB)  # micro × 4 MiB (float32), freed after the step
        if mode == "leak":
            kept.append(torch.ones(3 * MIB // 4))  # 3 MiB kept by mistake each step
        loss = model(torch.randn(micro, 64)).sum() + batch[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        del batch
        print(f"step {step}", flush=True)
        time.sleep(0.05 if mode == "leak" else 0.0)


if __name__ == "__main__":
    main()
