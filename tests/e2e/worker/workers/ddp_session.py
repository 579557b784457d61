"""One rank of the Session-under-DDP test: two Gloo ranks, a real allocator OOM on rank 0 only.

Run A starts at micro-batch 8; in its second step rank 0's forward allocates 2**60 bytes, so
PyTorch's ``DefaultCPUAllocator`` fails for real on that rank alone. Run B trains the same model
on the same data at micro-batch 4 from the start. The rank prints one JSON line: the micro-batch
and absorbed OOMs of every step of A, and the largest weight difference between A and B.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from oomguard.worker import Session, SessionConfig

STEPS, GLOBAL, WORLD = 3, 32, 2


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(GLOBAL // WORLD, 8, generator=g), torch.randn(GLOBAL // WORLD, 1, generator=g)


def train(rank: int, micro: int, oom_on_rank: int | None) -> tuple[nn.Module, list[tuple[int, int]]]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)),
                                    broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session: Session

    def loss_fn(m: nn.Module, part: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = part
        if rank == oom_on_rank and session.step_count == 1 and len(x) == 8:
            torch.empty(2**60, dtype=torch.uint8)  # a real DefaultCPUAllocator failure
        return nn.functional.mse_loss(m(x), y)

    config = SessionConfig(global_batch=GLOBAL, world_size=WORLD, rank=rank, micro_batch=micro, grow_after=None)
    steps = []
    with Session(model, opt, loss_fn, config) as session:
        for step in range(STEPS):
            result = session.step(batch(rank, step))
            steps.append((result.micro_batch, result.ooms))
    return model.module, steps


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    model_a, steps = train(rank, 8, oom_on_rank=0)
    model_b, _ = train(rank, 4, oom_on_rank=None)
    diff = max((a - b).abs().max().item() for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True))
    peers = [torch.cat([p.detach().reshape(-1) for p in model_a.parameters()]) for _ in range(WORLD)]
    dist.all_gather(peers, peers[rank].clone())
    print(json.dumps({"rank": rank, "steps": steps, "diff_vs_micro_4": diff,
                      "ranks_equal": bool(torch.equal(peers[0], peers[1]))}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
