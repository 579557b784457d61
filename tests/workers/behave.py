"""A configurable worker for the supervisor's integration tests: each behaviour is real (a real
exception, a real allocation, a real hang), chosen by the attempt and micro-batch it is given."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["torch_oom", "fragmented", "allocate", "hang", "crash", "pidfile", "resume"])
    p.add_argument("--fail-above", type=int, default=4, help="micro-batches above this fail")
    p.add_argument("--mb-per-sample", type=int, default=40)
    p.add_argument("--pidfile", type=Path)
    p.add_argument("--resume-from", type=Path)
    args = p.parse_args()
    micro = int(os.environ["OOMGUARD_MICRO_BATCH"])
    attempt = int(os.environ["OOMGUARD_ATTEMPT"])
    print(f"worker attempt={attempt} micro={micro} accum={os.environ['OOMGUARD_GRAD_ACCUM']} "
          f"alloc_conf={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}", flush=True)
    globals()[args.mode](args, micro, attempt)


def torch_oom(args: argparse.Namespace, micro: int, attempt: int) -> None:
    if micro > args.fail_above:
        import torch

        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of "
            "which 1.02 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and "
            "512.00 MiB is reserved by PyTorch but unallocated.")


def fragmented(args: argparse.Namespace, micro: int, attempt: int) -> None:
    if "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        import torch

        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of 79.11 GiB of "
            "which 100.00 MiB is free. Of the allocated memory 60.00 GiB is allocated by PyTorch, and "
            "9.50 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def allocate(args: argparse.Namespace, micro: int, attempt: int) -> None:
    """Touch micro × mb_per_sample MiB for real, a chunk at a time, and hold it a moment."""
    chunks = []
    for _ in range(micro * args.mb_per_sample // 8):
        chunks.append(bytearray(8 * 2**20))  # bytearray zero-fills: the pages are really used
        time.sleep(0.002)
    time.sleep(1.5)
    print(f"held {len(chunks) * 8} MiB", flush=True)


def hang(args: argparse.Namespace, micro: int, attempt: int) -> None:
    if attempt == 1:
        print("about to hang", flush=True)
        while True:
            time.sleep(1)


def crash(args: argparse.Namespace, micro: int, attempt: int) -> None:
    print("Traceback (most recent call last):\nValueError: bad data in shard 7", flush=True)
    sys.exit(3)


def pidfile(args: argparse.Namespace, micro: int, attempt: int) -> None:
    """Write our pid and wait to be killed (first attempt), or finish."""
    if attempt == 1:
        assert args.pidfile is not None
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        args.pidfile.write_text(str(os.getpid()))
        time.sleep(120)


def resume(args: argparse.Namespace, micro: int, attempt: int) -> None:
    import torch

    if args.resume_from is not None:
        state = torch.load(args.resume_from / "state.pt")
        print(f"resumed from {args.resume_from} step {state['step']}", flush=True)


if __name__ == "__main__":
    main()
