"""A seed-style DDP training script for the torchrun tests: Gloo on CPU, batch shape from flags.

It reads ``--micro-batch-size`` and ``--gradient-accumulation-steps`` like the scripts users bring
(oomguard fills them from ``{micro_batch}`` / ``{grad_accum}``), trains a tiny model for
``--steps`` optimizer steps, and rank 0 writes a checkpoint after every step. A fault is real and
strikes one rank only: ``--fault rlimit`` caps that rank's address space so PyTorch's allocator
fails (``DefaultCPUAllocator: can't allocate memory``); ``--fault touch`` fills memory until the
kernel OOM killer (of the memory cgroup the test made) kills the rank.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--gradient-accumulation-steps", type=int, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--resume-from", type=Path)
    p.add_argument("--fault", choices=["none", "rlimit", "touch", "exit", "cuda"], default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of 'work' per step")
    p.add_argument("--fault-node", type=int, help="strike on this node's ranks (oomguard's --node-rank) instead")
    p.add_argument("--fault-at", default="", help="MICRO:NODE,...: at that micro-batch, strike on that node's ranks "
                   "(oomguard's node number: OOMGUARD_NODE_RANK)")
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--fault-above", type=int, default=2, help="the fault strikes at micro-batches above this")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    args = p.parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum = args.micro_batch_size, args.gradient_accumulation_steps
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    if args.resume_from is not None:
        state = torch.load(args.resume_from / "state.pt", map_location=device)
        model.module.load_state_dict(state["model"])
        step = state["step"]
    print(f"rank {rank} attempt {os.environ.get('OOMGUARD_ATTEMPT')} micro {micro} accum {accum} world {world} "
          f"global {micro * accum * world} start_step {step} spawned {_spawned():.3f} ready {time.time():.3f}",
          flush=True)
    per_rank = micro * accum
    while step < args.steps:
        step += 1
        if step == args.fault_step and strikes(args, rank, micro):
            print(f"rank {rank} fault {args.fault} at {time.time():.3f} node {os.environ.get('OOMGUARD_NODE_RANK')}",
                  flush=True)
            if args.fault == "exit":
                os._exit(1)
            fault(args.fault)
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x, y = torch.randn(per_rank, 8, generator=gen).to(device), torch.randn(per_rank, 1, generator=gen).to(device)
        opt.zero_grad()
        for i in range(accum):
            part = slice(i * micro, (i + 1) * micro)
            loss = torch.nn.functional.mse_loss(model(x[part]), y[part]) / accum
            loss.backward()
        opt.step()
        time.sleep(args.step_sleep)
        if rank == 0:
            save(args.ckpt_dir, step, model.module.state_dict())
        dist.barrier()
    print(f"rank {rank} finished step {step}", flush=True)
    dist.destroy_process_group()


def strikes(args: argparse.Namespace, rank: int, micro: int) -> bool:
    node = int(os.environ.get("OOMGUARD_NODE_RANK", "0"))
    if args.fault_at:
        pairs = (pair.split(":") for pair in args.fault_at.split(","))
        return any(int(m) == micro and int(n) == node for m, n in pairs)
    return micro > args.fault_above and here(args, rank)


def here(args: argparse.Namespace, rank: int) -> bool:
    if args.fault_node is not None:
        return int(os.environ.get("OOMGUARD_NODE_RANK", "0")) == args.fault_node
    return rank == args.fault_rank


def _spawned() -> float:
    """When this process was started (wall clock), from /proc: before torch was imported."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def fault(kind: str) -> None:
    if kind == "rlimit":
        limit = 2 * 2**30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        torch.empty(4 * 2**30, dtype=torch.uint8)  # a real allocator failure: more than the cap
    elif kind == "cuda":
        torch.empty(2**50, dtype=torch.uint8, device="cuda")  # a real CUDA OOM: 1 PiB on this rank's GPU
    elif kind == "touch":
        held = []
        while True:  # until the kernel's OOM killer ends this rank
            held.append(bytearray(64 * 2**20))
            time.sleep(0.001)


def save(ckpt_dir: Path, step: int, model: dict[str, torch.Tensor]) -> None:
    """Atomically: a temporary directory renamed into place, so a half-written step is never seen."""
    tmp = ckpt_dir / f".tmp-step-{step}"
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "step": step}, tmp / "state.pt")
    os.replace(tmp, ckpt_dir / f"step-{step}")


if __name__ == "__main__":
    main()
