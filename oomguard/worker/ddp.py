"""Data-parallel ranks agree on an OOM before any collective that could hang.

Under DistributedDataParallel the gradient all-reduce runs inside the backward of the last
micro-batch. If one rank runs out of memory earlier in the step, the others reach that
all-reduce and wait for a peer that will never come. So, as Composer does, a session under DDP
computes every micro-batch with DDP's gradient sync off (``no_sync``), then all-reduces one flag
per step, "did any rank hit an OOM?", and only when no rank did, averages the gradients itself
(one flat all-reduce, the same mean DDP takes) before the optimizer step. A rank whose step hit
an OOM takes part in that same all-reduce from its recovery path, so every rank learns of it
at the same collective and redoes the step at the same smaller micro-batch.

Needs a model wrapped in DDP with ``broadcast_buffers=False`` when it has buffers: DDP would
otherwise broadcast them in every forward, a collective a failing rank never reaches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PEER_OOM = "peer_oom"  # the step's OOM happened on another rank


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this step; this one redoes it with them."""


class RankAgreement:
    """The collectives a session uses to keep its ranks in step; one per session under DDP."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.world = dist.get_world_size()
        on_gpu = dist.get_backend() == "nccl"
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = device if on_gpu else torch.device("cpu")

    @staticmethod
    def of(model: torch.nn.Module) -> RankAgreement | None:
        """Agreement for a DDP-wrapped model in an initialized process group of several ranks."""
        # DDP only: FSDP also has no_sync(), but its gradients are sharded, not replicated
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if not ddp or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size() < 2:
            return None
        if getattr(model, "broadcast_buffers", False) and any(True for _ in model.buffers()):
            raise ValueError("Session under DDP needs DistributedDataParallel(..., broadcast_buffers=False): "
                             "a buffer broadcast in forward would hang when another rank hits an OOM")
        return RankAgreement(model)

    def any_oom(self, mine: bool) -> bool:
        """All-reduce (MAX) of this rank's OOM flag: True when any rank hit one in this step."""
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def smallest(self, value: int) -> int:
        """All-reduce (MIN): the micro-batch every rank can run."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def settle(self) -> None:
        """After the step's micro-batches: raise PeerOutOfMemory if a peer failed, else average the
        gradients over the ranks (what DDP's reducer would have done)."""
        if self.any_oom(False):
            raise PeerOutOfMemory("another rank ran out of memory in this step")
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            n = grad.numel()
            param.grad = flat[offset:offset + n].view_as(grad).clone()
            offset += n
