"""The distributed cases of the probe's matrix: two ranks on gloo (torch.multiprocessing.spawn), the
tiny model under DDP or FSDP2 (``fully_shard``). Rank 0 writes matrix_report's file with the loss
averaged over the ranks."""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from matrix_report import Steps
from tiny import LM, batch

WORLD = 2


def wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_main(rank: int, how: str, steps: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = wrap(LM(), how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = Steps()
    for step in range(steps):
        out.start()
        loss = model(*batch(step * WORLD + rank))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.done(mean / WORLD)
    if rank == 0:
        out.write()
    dist.barrier()  # both ranks done before either tears gloo down (a rank that left early aborted the other's)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=["ddp", "fsdp2"], required=True)
    parser.add_argument("--steps", type=int, default=6)
    args: Any = parser.parse_args()
    mp.spawn(rank_main, args=(args.how, args.steps, free_port()), nprocs=WORLD)


if __name__ == "__main__":
    main()
