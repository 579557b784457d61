"""The worker ``bench/web_load.py`` supervises: real PyTorch training (CPU), then a CUDA OOM.

Each attempt trains a small MLP for ``TRAIN_S`` seconds, then writes the time it is about to exit
to ``EXITS`` and dies with PyTorch's OOM text, so oomguard halves the micro-batch and restarts it.
The micro-batch is nominal (the model trains at a fixed batch): only the restarts are measured.
"""

from __future__ import annotations

import os
import sys
import time

import torch

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
       "capacity of 79.10 GiB of which 1.06 GiB is free.\n")


def train(seconds: float) -> int:
    # One CPU thread: on a GPU box the training process keeps about one core busy; letting CPU
    # training take every core of a small CI machine would measure CPU starvation, not the web.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    steps, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    return steps


def main() -> None:
    steps = train(float(os.environ.get("TRAIN_S", "1.5")))
    print(f"attempt {os.environ['OOMGUARD_ATTEMPT']}: {steps} steps at micro-batch "
          f"{os.environ['OOMGUARD_MICRO_BATCH']}", flush=True)
    sys.stderr.write(OOM)
    sys.stderr.flush()
    with open(os.environ["EXITS"], "a") as fh:
        fh.write(f"{os.environ['OOMGUARD_ATTEMPT']} {time.time()}\n")
    os._exit(1)  # skip interpreter teardown: the exit time written above is the exit


if __name__ == "__main__":
    main()
