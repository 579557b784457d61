"""Workers whose memory fails for a reason other than the batch, each for real: a leak, a phase
spike in evaluation, a DataLoader worker the OOM killer takes, and (for contrast) per-sample memory,
and a stretch of long sequences (``--spike-at``) on top of any of them.

Every mode trains in steps, reports them on the worker channel (``OOMGUARD_EVENTS``) and prints
them; ``leak`` and ``per_sample`` checkpoint to ``--ckpt-dir`` (``ck-STEP``, written atomically),
resume from the newest, save on the checkpoint signal and, as preemption-aware scripts do, on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

MIB = 2**20


def emit(kind: str, **fields: object) -> None:
    path = os.environ.get("OOMGUARD_EVENTS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"type": kind, "t": time.time(), **fields}) + "\n")


def touch(n_mib: float) -> bytearray:
    return bytearray(int(n_mib * MIB))  # zero-filled: the pages are really used


class Checkpoints:
    """ck-STEP files in one directory, written with tmp + rename."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def newest(self) -> int:
        steps = [int(p.name.split("-")[1]) for p in self.dir.glob("ck-*")]
        return max(steps, default=0)

    def save(self, step: int) -> None:
        tmp = self.dir / f".tmp-{step}"
        tmp.write_text(str(step))
        os.replace(tmp, self.dir / f"ck-{step}")
        emit("checkpoint", path=str(self.dir / f"ck-{step}"), step=step)
        print(f"saved checkpoint at step {step}", flush=True)


def train(args: argparse.Namespace, micro: int, leak_mb: float) -> None:
    """Hold ``micro`` × per-sample MiB, then train; each step keeps ``leak_mb`` MiB by mistake. From
    step ``--spike-at`` on, for ``--spike-steps`` steps, a stretch of long sequences needs
    ``--spike-mb`` MiB more a sample (allocated in the step, freed after it)."""
    ckpts = Checkpoints(args.ckpt_dir)
    step = ckpts.newest()
    print(f"start micro={micro} at step {step}", flush=True)
    held = [touch(args.per_sample_mb) for _ in range(micro)]
    leaked: list[bytearray] = []
    flags = {"save": False, "stop": False}
    signal.signal(signal.SIGUSR1, lambda s, f: flags.__setitem__("save", True))
    signal.signal(signal.SIGTERM, lambda s, f: flags.__setitem__("stop", True))
    while step < args.steps:
        time.sleep(args.step_time)
        step += 1
        if leak_mb:
            leaked.append(touch(leak_mb))  # the loss tensor kept in a list
        if args.spike_at and args.spike_at <= step < args.spike_at + args.spike_steps:
            print(f"step {step}: long sequences, {args.spike_mb * micro} MiB of activations", flush=True)
            activations = touch(args.spike_mb * micro)
            del activations
        emit("progress", step=step, micro_batch=micro)
        if step % args.ckpt_every == 0 or flags["save"] or flags["stop"]:
            flags["save"] = False
            ckpts.save(step)
        if flags["stop"]:
            print(f"stopped at step {step}", flush=True)
            sys.exit(143)
    print(f"done micro={micro} steps={step} held={len(held) * args.per_sample_mb} MiB", flush=True)


def leak(args: argparse.Namespace, micro: int) -> None:
    train(args, micro, args.leak_mb)


def per_sample(args: argparse.Namespace, micro: int) -> None:
    train(args, micro, 0)


def creep(args: argparse.Namespace, micro: int) -> None:
    """Memory that creeps by ``--creep-mb`` a step (allocator caches, a metrics list), usually with a
    ``--spike-at`` stretch: the same loop as ``leak``, named for what a person would call it."""
    train(args, micro, args.leak_mb)


def evaluate(model: object, eval_batch: int, mib_per_sample: int) -> int:
    """The evaluation pass: activations for the whole eval batch at once."""
    import torch

    out = torch.ones(eval_batch * mib_per_sample * MIB // 4, dtype=torch.float32)
    return int(out.numel())


def budget(mib: int) -> None:
    """RLIMIT_AS at the address space in use now plus ``mib``: beyond it PyTorch's real allocator fails."""
    import resource

    import torch

    torch.set_num_threads(1)  # thread pools and their malloc arenas are mapped before the budget starts
    torch.ones(MIB).sum()
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + mib * MIB
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def eval_spike(args: argparse.Namespace, micro: int) -> None:
    """Training steps that fit; evaluation at --eval-batch that may not (RLIMIT_AS: the real
    DefaultCPUAllocator error)."""
    import torch

    budget(args.budget_mb)
    for step in range(1, 4):
        x = torch.ones(micro * MIB // 4)  # 1 MiB a sample: training fits
        emit("progress", step=step)
        del x
    print(f"evaluating at eval batch {args.eval_batch}", flush=True)
    evaluate(None, args.eval_batch, args.per_sample_mb)
    print(f"done micro={micro} eval_batch={args.eval_batch}", flush=True)


def save_checkpoint(weights: object, staging_mib: int) -> None:
    """Saving gathers the state into one staging buffer first: its memory is the model's, not the batch's."""
    import torch

    staging = torch.empty(staging_mib * MIB // 4)
    del staging, weights


def save_spike(args: argparse.Namespace, micro: int) -> None:
    """Training fits at any micro-batch; saving needs --per-sample-mb × 16 MiB whatever the batch."""
    import torch

    budget(args.budget_mb)
    for step in range(1, 4):
        x = torch.ones(micro * MIB // 4)
        emit("progress", step=step)
        del x
    print("saving checkpoint", flush=True)
    save_checkpoint(None, args.per_sample_mb * 16)
    print(f"done micro={micro}", flush=True)


class ShardedCache:
    """A dataset whose every loader worker builds its own lookup cache (``--worker-cache-mb``) on
    its first items: memory per worker, whatever the batch."""

    def __init__(self, n: int, cache_mb: int) -> None:
        self.n = n
        self.cache_mb = cache_mb
        self.cache: list[bytearray] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if len(self.cache) * 16 < self.cache_mb:
            self.cache.append(touch(16))
            time.sleep(0.02)
        return i


def dataloader(args: argparse.Namespace, micro: int) -> None:
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    print(f"start micro={micro} num_workers={args.num_workers}", flush=True)
    loader = DataLoader(ShardedCache(400, args.worker_cache_mb), batch_size=micro, num_workers=args.num_workers)
    seen = 0
    for step, batch in enumerate(loader, 1):
        seen += len(batch)
        emit("progress", step=step)
        time.sleep(0.005)
    print(f"done micro={micro} num_workers={args.num_workers} samples={seen}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["leak", "creep", "per_sample", "eval_spike", "save_spike", "dataloader"])
    p.add_argument("--micro", type=int, default=0, help="micro-batch (default: OOMGUARD_MICRO_BATCH)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("ck"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--per-sample-mb", type=int, default=2)
    p.add_argument("--leak-mb", "--creep-mb", dest="leak_mb", type=float, default=4)
    p.add_argument("--spike-at", type=int, default=0, help="the first step of a stretch of long sequences (0: none)")
    p.add_argument("--spike-steps", type=int, default=10)
    p.add_argument("--spike-mb", type=float, default=20, help="MiB more a sample during the stretch")
    p.add_argument("--eval-batch", type=int, default=0)
    p.add_argument("--budget-mb", type=int, default=100)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--worker-cache-mb", type=int, default=128)
    args = p.parse_args()
    micro = args.micro or int(os.environ["OOMGUARD_MICRO_BATCH"])
    if not args.eval_batch:
        args.eval_batch = micro
    globals()[args.mode](args, micro)


if __name__ == "__main__":
    main()
