"""A CUDA leak for a GPU machine: tensors kept in a list every step, under
``torch.cuda.set_per_process_memory_fraction`` so the device's limit is small and known.

Checkpoints to ``--ckpt-dir`` (``ck-STEP``), resumes from the newest, saves on SIGUSR1 and SIGTERM.
Run by tests/e2e/test_causes.py::test_e_cuda_leak_under_a_memory_fraction (skipped without CUDA).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from causes import Checkpoints, emit


def main() -> None:
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--leak-mb", type=int, default=64)
    p.add_argument("--ckpt-every", type=int, default=10)
    args = p.parse_args()
    micro = int(os.environ["OOMGUARD_MICRO_BATCH"])
    torch.cuda.set_per_process_memory_fraction(args.fraction)
    ckpts = Checkpoints(args.ckpt_dir)
    step = ckpts.newest()
    held = torch.ones(micro, 2**18, device="cuda")  # 1 MiB a sample
    leaked = []
    flags = {"save": False, "stop": False}
    signal.signal(signal.SIGUSR1, lambda s, f: flags.__setitem__("save", True))
    signal.signal(signal.SIGTERM, lambda s, f: flags.__setitem__("stop", True))
    while step < args.steps:
        time.sleep(args.step_time)
        step += 1
        leaked.append(torch.ones(args.leak_mb * 2**18, device="cuda"))  # the loss kept by mistake
        emit("progress", step=step)
        if step % args.ckpt_every == 0 or flags["save"] or flags["stop"]:
            flags["save"] = False
            ckpts.save(step)
        if flags["stop"]:
            sys.exit(143)
    print(f"done micro={micro} steps={step} held={held.numel() * 4 >> 20} MiB", flush=True)


if __name__ == "__main__":
    main()
