"""A nanoGPT-style training script: ``--key=value`` overrides of module globals, one ``out/ckpt.pt``
rewritten at each evaluation, ``--init_from=resume``, and the log lines nanoGPT prints
(``step N: train loss ...`` at evaluations, ``iter N: loss ...`` each iteration), and nanoGPT's
``compile = True``: the model is ``torch.compile``d (inductor, on CPU too) before DDP wraps it, and
the checkpoint holds the compiled module's state (keys ``_orig_mod.*``), which a resume strips as
nanoGPT does. ``--compile=False`` trains it eagerly, as nanoGPT's README runs it on a laptop.

The checkpoint's name carries no step, so oomguard takes its step from the output. With
``--memory_budget_mb`` the process gets a host memory budget (RLIMIT_AS) after iteration
``--budget_from_iter``: a batch too large for it then fails in PyTorch's real allocator.

    oomguard run --micro-batch 16 --global-batch 32 --checkpoint 'out/ckpt.pt' \\
        --resume-args '--init_from=resume' -- \\
        python examples/train_nanogpt_style.py --batch_size={micro_batch} \\
        --gradient_accumulation_steps={grad_accum} --memory_budget_mb=85

Under torchrun it runs DDP as nanoGPT does (Gloo on CPU), and as nanoGPT does it takes
``--gradient_accumulation_steps`` summed over the ranks and divides it by ``WORLD_SIZE``: give it
``{grad_accum_total}``, not the per-rank ``{grad_accum}``:

    oomguard run --micro-batch 4 --global-batch 16 --checkpoint 'out/ckpt.pt' --resume-args '--init_from=resume' \\
        -- torchrun --standalone --nproc_per_node=2 examples/train_nanogpt_style.py --batch_size={micro_batch} \\
        --gradient_accumulation_steps={grad_accum_total} --memory_budget_mb=85
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
from ast import literal_eval

import torch
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

batch_size = 8
gradient_accumulation_steps = 4
block_size = 128
vocab_size = 4096
max_iters = 8
eval_interval = 3
out_dir = "out"
init_from = "scratch"
memory_budget_mb = 0
budget_from_iter = 4
compile = True  # nanoGPT's default: use PyTorch 2.0 to compile the model to be faster


def configure(argv: list[str]) -> None:
    for arg in argv:  # nanoGPT's configurator.py, without exec
        key, eq, value = arg.removeprefix("--").partition("=")
        if key not in globals() or not eq:
            sys.exit(f"unknown or malformed override {arg!r}")
        try:
            parsed = literal_eval(value)  # as nanoGPT's: --compile=False is a bool, --init_from=resume a str
        except (SyntaxError, ValueError):
            parsed = value
        if type(parsed) is not type(globals()[key]):
            sys.exit(f"override {arg!r} is a {type(parsed).__name__}, not a {type(globals()[key]).__name__}")
        globals()[key] = parsed


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 32)
        self.block = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.head = nn.Linear(32, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        logits = self.head(x + self.block(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def get_batch(it: int, micro_step: int, seed_offset: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(it * 1000 + micro_step * 10 + seed_offset)
    return torch.randint(0, vocab_size, (batch_size, block_size + 1), generator=g)


def fixed_mmap_threshold() -> None:
    """Large blocks from mmap, returned to the system when freed: glibc otherwise raises its mmap
    threshold after the first large free and serves later blocks from a heap that never shrinks, so
    the address space (what RLIMIT_AS counts) would keep what a checkpoint save once used."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it ends the dynamic rise
    except (OSError, AttributeError):
        pass  # not glibc: the budget is only a demonstration


def limit_memory() -> None:
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + memory_budget_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    global gradient_accumulation_steps
    configure(sys.argv[1:])
    ddp = int(os.environ.get("RANK", -1)) != -1  # nanoGPT: is this a ddp run?
    if ddp:
        init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        ddp_rank = int(os.environ["RANK"])
        ddp_world_size = int(os.environ["WORLD_SIZE"])
        master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
        seed_offset = ddp_rank  # each process gets a different seed
        # world_size number of processes will be training simultaneously, so we can scale
        # down the desired gradient accumulation iterations per process proportionally
        assert gradient_accumulation_steps % ddp_world_size == 0
        gradient_accumulation_steps //= ddp_world_size
    else:
        master_process, seed_offset, ddp_world_size = True, 0, 1
    tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
    if master_process:
        print(f"tokens per iteration will be: {tokens_per_iter:,}", flush=True)
    if memory_budget_mb:
        fixed_mmap_threshold()
    torch.manual_seed(1337)
    torch.set_num_threads(1)
    raw_model: nn.Module = TinyLM()
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)
    iter_num = 0
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    if init_from == "resume":
        print(f"Resuming training from {out_dir}", flush=True)
        checkpoint = torch.load(ckpt_path)
        # a compiled model's checkpoint says _orig_mod. before each key; nanoGPT strips it the same way
        unwanted_prefix = "_orig_mod."
        state_dict = {k.removeprefix(unwanted_prefix): v for k, v in checkpoint["model"].items()}
        raw_model.load_state_dict(state_dict)
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num = checkpoint["iter_num"]
    model: nn.Module = raw_model
    if compile:
        print("compiling the model... (takes a ~minute)", flush=True)
        model = torch.compile(model)
    if ddp:
        model = DDP(model)
    raw_model = model.module if ddp else model  # nanoGPT's: the compiled module, whose state it saves
    while True:
        if iter_num % eval_interval == 0 and master_process:
            print(f"step {iter_num}: train loss {0.0:.4f}, val loss {0.0:.4f}", flush=True)
            if iter_num > 0:
                os.makedirs(out_dir, exist_ok=True)
                print(f"saving checkpoint to {out_dir}", flush=True)
                state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
                torch.save(state, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
        t0 = time.time()
        for micro_step in range(gradient_accumulation_steps):
            if ddp:  # sync gradients at the last micro step only, as nanoGPT does
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            loss = model(get_batch(iter_num, micro_step, seed_offset)) / gradient_accumulation_steps
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master_process:
            print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, "
                  f"time {(time.time() - t0) * 1000:.2f}ms, mfu -100.00%", flush=True)
        if memory_budget_mb and iter_num == budget_from_iter:
            limit_memory()
        iter_num += 1
        if iter_num > max_iters:
            break
    if ddp:
        destroy_process_group()


if __name__ == "__main__":
    main()
