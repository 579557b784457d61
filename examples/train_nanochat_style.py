"""A nanochat-style training script: ``--key=value`` overrides, the accumulation derived from a total
batch in tokens, ``model_NNNNNN.pt`` checkpoints and ``--resume_from_step=N``.

The script takes only the device batch; oomguard keeps ``total_batch_size`` (the global batch) and
the script derives its own accumulation from it, so the form is the one nanochat's ``base_train``
documents. With ``--memory_budget_mb`` the process gets a host memory budget (RLIMIT_AS) once step
``--budget_from_step`` is done: a device batch too large for it then fails in PyTorch's real
allocator after a checkpoint exists.

    oomguard run --micro-batch 16 --global-batch 32 --checkpoint 'out/model_*.pt' \\
        --resume-args '--resume_from_step={checkpoint_step}' -- \\
        python examples/train_nanochat_style.py --device_batch_size={micro_batch} --total_batch_size=4096 \\
        --checkpoint_dir=out --memory_budget_mb=75
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

# nanochat's configurator: defaults as globals, overridden by --key=value
device_batch_size = 8
total_batch_size = 4096  # tokens per optimizer step
seq_len = 128
vocab = 4096
num_iterations = 8
save_every = 2
checkpoint_dir = "out"
resume_from_step = -1
memory_budget_mb = 0
budget_from_step = 2


def configure(argv: list[str]) -> None:
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        if key not in globals() or not _:
            sys.exit(f"unknown or malformed override {arg!r}")
        globals()[key] = type(globals()[key])(value)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.block = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.head = nn.Linear(32, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        logits = self.head(x + self.block(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int, micro: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch n of step ``step``: the same tokens whatever the device batch."""
    g = torch.Generator().manual_seed(step * 1000 + n)
    tokens = torch.randint(0, vocab, (micro, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def save(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """model_NNNNNN.pt written to a temp name and renamed; the optimizer and meta beside it."""
    out = Path(checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(opt.state_dict(), out / f"optim_{step:06d}.pt")
    (out / f"meta_{step:06d}.json").write_text(json.dumps({"step": step, "device_batch_size": device_batch_size}))
    tmp = out / f".model_{step:06d}.pt.tmp"
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, out / f"model_{step:06d}.pt")
    print(f"saved checkpoint to {out / f'model_{step:06d}.pt'}", flush=True)


def limit_memory() -> None:
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + memory_budget_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    configure(sys.argv[1:])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokens_per_micro = device_batch_size * seq_len
    assert total_batch_size % tokens_per_micro == 0, "total_batch_size must be a multiple of the device batch"
    grad_accum_steps = total_batch_size // tokens_per_micro
    print(f"device batch {device_batch_size}, gradient accumulation steps {grad_accum_steps}", flush=True)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if resume_from_step >= 0:
        out = Path(checkpoint_dir)
        model.load_state_dict(torch.load(out / f"model_{resume_from_step:06d}.pt"))
        opt.load_state_dict(torch.load(out / f"optim_{resume_from_step:06d}.pt"))
        start = resume_from_step
        print(f"resumed from step {start}", flush=True)
    for step in range(start, num_iterations):
        t0 = time.time()
        loss_sum = 0.0
        for n in range(grad_accum_steps):
            x, y = batch(step, device_batch_size, n)
            loss = model(x, y) / grad_accum_steps
            loss.backward()
            loss_sum += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        print(f"step {done:05d}/{num_iterations:05d} ({100 * done / num_iterations:.2f}%) | loss: {loss_sum:.6f} "
              f"| dt: {1000 * (time.time() - t0):.2f}ms", flush=True)
        if done % save_every == 0 or done == num_iterations:
            save(done, model, opt)
        if memory_budget_mb and done == budget_from_step:
            limit_memory()


if __name__ == "__main__":
    main()
