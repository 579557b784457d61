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
    p.add_argument("mode", choices=["torch_oom", "fragmented", "allocate", "hang", "crash", "pidfile", "resume",
                                    "grow_rss", "model", "stepless_checkpoint", "lock", "loader_deadlock", "spin"])
    p.add_argument("--fixed-mb", type=int, default=10)
    p.add_argument("--hold", type=float, default=3.0)
    p.add_argument("--ckpt-dir", type=Path)
    p.add_argument("--fail-above", type=int, default=4, help="micro-batches above this fail")
    p.add_argument("--mb-per-sample", type=int, default=40)
    p.add_argument("--pidfile", type=Path)
    p.add_argument("--resume-from", type=Path)
    p.add_argument("--resume-step", help="the step to resume at, as the supervisor rendered it")
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


def grow_rss(args: argparse.Namespace, micro: int, attempt: int) -> None:
    """Grow slowly towards micro × mb_per_sample MiB; say when a checkpoint request arrives."""
    request = Path(os.environ["OOMGUARD_CHECKPOINT_REQUEST"])

    def on_request(signum: int, frame: object) -> None:
        print(f"checkpoint request received (signal {signum}, file {request.exists()})", flush=True)
        request.unlink(missing_ok=True)

    signal.signal(signal.SIGUSR1, on_request)
    chunks = []
    for _ in range(micro * args.mb_per_sample // 4):
        chunks.append(bytearray(4 * 2**20))
        time.sleep(0.05)
    print(f"held {len(chunks) * 4} MiB", flush=True)


def model(args: argparse.Namespace, micro: int, attempt: int) -> None:
    """Memory = fixed + per-sample × micro, for real; writes a checkpoint file every 0.3 s."""
    assert args.ckpt_dir is not None
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    held = [bytearray(args.fixed_mb * 2**20)]
    for _ in range(micro):
        held.append(bytearray(args.mb_per_sample * 2**20))
    step = len(list(args.ckpt_dir.iterdir()))
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:
        time.sleep(0.3)
        step += 1
        (args.ckpt_dir / f"ck-{step}").write_text(str(micro))
    print(f"finished at micro {micro} holding {sum(map(len, held)) >> 20} MiB", flush=True)


def hang(args: argparse.Namespace, micro: int, attempt: int) -> None:
    if attempt == 1:
        print("about to hang", flush=True)
        while True:
            time.sleep(1)


def lock(args: argparse.Namespace, micro: int, attempt: int) -> None:
    """Blocked for ever on a lock it already holds (the first attempt), CPU idle."""
    if attempt == 1:
        import threading

        print("about to block on a lock", flush=True)
        held = threading.Lock()
        held.acquire()
        held.acquire()


def loader_deadlock(args: argparse.Namespace, micro: int, attempt: int) -> None:
    """The first attempt waits for a batch from two DataLoader workers deadlocked on a lock that was
    held when they forked (the classic fork-with-a-held-lock): every process of the tree idle."""
    if attempt > 1:
        return
    import threading

    import torch

    held = threading.Lock()

    class Data(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            with held:  # never released in a forked child
                return torch.zeros(4)

    held.acquire()
    batches = iter(torch.utils.data.DataLoader(Data(), batch_size=micro, num_workers=2))
    print("waiting for the first batch", flush=True)
    next(batches)


def spin(args: argparse.Namespace, micro: int, attempt: int) -> None:
    """Busy for --hold seconds printing nothing (a long silent epoch), then done."""
    print("spinning", flush=True)
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:
        sum(range(1000))
    print("done spinning", flush=True)


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


def stepless_checkpoint(args: argparse.Namespace, micro: int, attempt: int) -> None:
    """nanoGPT's shape: ``step N:`` lines, one checkpoint file with no step in its name rewritten
    every 2 steps; the first attempt crashes after step 5. A resumed one says the step it was given."""
    ckpt = args.ckpt_dir / "ckpt.txt"
    if args.resume_step is not None:
        print(f"resume step given {args.resume_step!r}, in the file {ckpt.read_text()!r}", flush=True)
        return
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    for step in range(1, 6):
        time.sleep(0.3)
        print(f"step {step}: loss 1.0", flush=True)
        if step % 2 == 0:
            (args.ckpt_dir / ".ckpt.tmp").write_text(str(step))
            os.replace(args.ckpt_dir / ".ckpt.tmp", ckpt)
    if attempt == 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
