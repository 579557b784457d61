"""The one workload every contender of bench/peers.py trains, and the records it keeps of itself.

A small GPT-style language model (nanoGPT's shape: token + position embeddings, pre-norm blocks of
causal self-attention and an MLP, a tied head) on random tokens. Everything a contender needs to
know about the benchmark comes through ``PEERS_*`` environment variables, so the training scripts
stay the plain scripts users write:

- ``PEERS_RECORDS``: a JSONL file. The model appends what it did itself (process start, imports
  done, model built, data ready, each micro-batch's forward and completed backward, each optimizer
  step with the samples that step really trained on), so the harness reads the trained batch, the
  OOMs and the steps redone from the script's own records, not from what a tool says it did.
- ``PEERS_BUDGET_MB``: the memory cap. At the first training forward (the same point for every
  contender, after each framework has imported and set up what it needs) the process caps itself
  at what it uses then plus this budget: RLIMIT_AS on CPU, so PyTorch's allocator really fails
  (``DefaultCPUAllocator: can't allocate memory``); on CUDA ``set_per_process_memory_fraction``, so
  the caching allocator raises a real ``torch.OutOfMemoryError``.
- ``PEERS_DEVICE``: ``cpu`` or ``cuda``.
- ``PEERS_CPU``: the one CPU every contender's process is pinned to (none: not pinned).
- ``PEERS_SLOWDOWN``: a fraction; the plain script then spins for that share of each step's time
  after the step (the benchmark's self-check: a 5 %-slower variant must be told apart). The share
  is of the clock the benchmark times that device by: the thread's CPU time on CPU, wall on CUDA.

Timing: every record carries two clocks, ``t`` (wall, ``time.time()``) and ``cpu`` (this thread's
CPU time, ``time.thread_time()``). On CPU the training runs in this one thread (one intra-op thread,
no inter-op work), so ``cpu`` counts the training's own work and nothing another process does on a
shared core: the benchmark times CPU steps by it. Every record that times something (``opt``,
``model``, ``data``) waits for the device first (``torch.cuda.synchronize`` on CUDA), so a step's
record is stamped when its kernels are done, not when they were queued. ``fwd`` and ``bwd`` only
count samples and are not synchronized.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Shape:
    vocab: int = 1024
    seq: int = 128
    dim: int = 128
    heads: int = 4
    layers: int = 2


SHAPE = Shape()
SEED = 0


def contender_args(doc: str) -> argparse.Namespace:
    """What every peer's script takes: the global batch asked for and the optimizer steps."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--steps", type=int, default=20)
    return p.parse_args()


def device() -> torch.device:
    return torch.device(os.environ.get("PEERS_DEVICE", "cpu"))


def setup() -> None:
    """One CPU thread for every contender, pinned to one core when ``PEERS_CPU`` says so: the box
    has 2 cores shared with other work, and one thread on one core keeps the figures comparable
    between contenders (and no thread pool is created after the address-space cap)."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # a framework already started the inter-op pool: it stays idle on CPU
        pass
    cpu = os.environ.get("PEERS_CPU")
    if cpu and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(cpu)})
    # oneDNN's kernels (GELU, matmuls) allocate their scratch memory outside PyTorch's allocator and
    # fail as "could not create a primitive", which no tool (nor a GPU run) reports as an OOM; with
    # them off every allocation goes through DefaultCPUAllocator and fails as a real CPU OOM.
    torch.backends.mkldnn.enabled = False
    torch.manual_seed(SEED)
    mark("settings", **settings())


# ----- records


class Records:
    """Append-only JSONL of what this process did; each line is written at once (a process that
    dies of an OOM keeps what it wrote)."""

    def __init__(self, path: str | None) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None

    def write(self, event: str, t: float | None = None, **fields: Any) -> None:
        if self.fd is not None:
            line = json.dumps({"ev": event, "t": time.time() if t is None else t, "cpu": time.thread_time(),
                               "pid": os.getpid(), **fields})
            os.write(self.fd, (line + "\n").encode())


RECORDS = Records(os.environ.get("PEERS_RECORDS"))


TIMED = ("opt", "model", "data")  # the records a figure is timed by: stamped once the device is done


def mark(event: str, t: float | None = None, **fields: Any) -> None:
    if event in TIMED and t is None:
        synchronize()
    RECORDS.write(event, t, **fields)


def synchronize() -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously; on CPU nothing waits)."""
    if device().type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step_clock() -> Callable[[], float]:
    """The clock a step is timed by on this device: the thread's CPU time on CPU (another
    process's share of a loaded core does not move it), wall on CUDA (the GPU's work is not
    this thread's CPU time; every timed record synchronizes first)."""
    return time.perf_counter if device().type == "cuda" else time.thread_time


class Pace:
    """``PEERS_SLOWDOWN``: after each step, spin for that share of the step's own time (0: never)."""

    def __init__(self) -> None:
        self.share = float(os.environ.get("PEERS_SLOWDOWN", "0") or 0)
        self.clock = step_clock()
        self.last = self.clock()

    def step_done(self) -> None:
        now = self.clock()
        if self.share > 0:
            # Spin, not sleep: a sleep costs no CPU time. On the CPU clock the spin is this thread's
            # own work, so it adds the share whatever else runs on the core; timed by wall, a spin
            # that is preempted ends early and a loaded core hid the 5 % (1.27x the unslowed rate).
            until = now + self.share * (now - self.last)
            while self.clock() < until:
                pass
        self.last = self.clock()


# ----- the memory cap


_capped = False


def cap_memory_once() -> None:
    """Cap this process at what it uses now plus ``PEERS_BUDGET_MB`` (once, at the first forward)."""
    global _capped
    budget = int(os.environ.get("PEERS_BUDGET_MB", "0")) * 2**20
    if _capped or budget <= 0:
        return
    _capped = True
    if device().type == "cuda":
        used = torch.cuda.memory_reserved()
        total = torch.cuda.get_device_properties(device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (used + budget) / total))
        mark("cap", bytes=used + budget, kind="cuda_fraction")
        return
    vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = vm_kb * 1024 + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    mark("cap", bytes=limit, kind="rlimit_as")


def install_exit_record() -> None:
    """Record an uncaught exception's time before the interpreter tears down (the restart path's
    split starts at the OOM, not at the process's exit)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        mark("exception", error=f"{kind.__name__}: {str(exc)[:200]}")
        previous(kind, exc, tb)

    sys.excepthook = hook
    atexit.register(mark, "exit")


# ----- the model


class Block(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.ln1, self.ln2 = nn.LayerNorm(shape.dim), nn.LayerNorm(shape.dim)
        self.qkv = nn.Linear(shape.dim, 3 * shape.dim)
        self.proj = nn.Linear(shape.dim, shape.dim)
        self.mlp = nn.Sequential(nn.Linear(shape.dim, 4 * shape.dim), nn.GELU(), nn.Linear(4 * shape.dim, shape.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        # Explicit attention (not SDPA's fused kernel): its T x T scores are the activation memory
        # that grows with the micro-batch, as in the models users train on GPUs.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


def _init(module: nn.Module) -> None:
    # GPT-2's initialization: small normal weights, zero biases (a sane loss from the first step).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyGPT(nn.Module):
    """Returns ``{"loss": ...}`` given ``input_ids`` of shape (batch, seq + 1): next-token loss.

    It also writes the records: ``fwd`` when a training forward starts, ``bwd`` when that
    micro-batch's backward has reached the embeddings (it completed), so the harness counts the
    samples that went into each optimizer step and the forwards that never finished (OOMs).
    """

    def __init__(self, shape: Shape = SHAPE) -> None:
        super().__init__()
        self.shape = shape
        self.tok = nn.Embedding(shape.vocab, shape.dim)
        self.pos = nn.Embedding(shape.seq, shape.dim)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        self.apply(_init)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> dict[str, torch.Tensor]:
        training = torch.is_grad_enabled() and self.training
        if training:
            cap_memory_once()
            n = int(input_ids.shape[0])
            mark("fwd", n=n)
        tokens, targets = input_ids[:, :-1], input_ids[:, 1:]
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        if training:
            x.register_hook(_backward_done(self, n))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten())}


def _backward_done(model: TinyGPT, n: int) -> Any:
    def hook(grad: torch.Tensor) -> None:
        # The position embedding gets its gradient only through x, after this hook: no gradient
        # there yet means this micro-batch is the first since the gradients were cleared, so the
        # harness starts a new sum (whatever an OOM'd attempt left before is not in this step).
        mark("bwd", n=n, fresh=model.pos.weight.grad is None)

    return hook


def _record_steps() -> None:
    """``opt_pre`` / ``opt`` records around every optimizer step of any optimizer (global hooks:
    the frameworks build and wrap their optimizers themselves). The samples in a step are the
    ``bwd`` records since the last fresh one; an ``opt_pre`` with no ``opt`` is an OOM in the step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda opt, args, kwargs: mark("opt_pre"))
    register_optimizer_step_post_hook(lambda opt, args, kwargs: mark("opt", **thread_usage()))


def thread_usage() -> dict[str, float]:
    """This thread's page faults and its user and system CPU seconds so far (``getrusage``): where a
    step's CPU time went, so two runs of the same step that differ can be told apart by why (a
    minor fault is charged to the thread's system time)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    u = resource.getrusage(who)
    return {"minflt": u.ru_minflt, "majflt": u.ru_majflt, "utime": u.ru_utime, "stime": u.ru_stime}


SETTINGS_ENV = ("MALLOC_", "GLIBC_TUNABLES", "OMP_", "MKL_", "KMP_", "PYTORCH_", "OOMGUARD_", "PYTHON", "LD_")


def settings() -> dict[str, Any]:
    """What of this process's settings could make the same step run at another speed: its
    priority, threads, CPUs, address-space cap, the allocator and threading variables, what was
    imported before the script (a probe through sitecustomize)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(SETTINGS_ENV) and k != "PYTHONPATH"}
    return {"nice": os.getpriority(os.PRIO_PROCESS, 0), "threads": torch.get_num_threads(),
            "interop": torch.get_num_interop_threads(),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0], "env": env,
            "pythonpath": os.environ.get("PYTHONPATH", ""),
            "probe": "_oomguard_probe" in sys.modules}  # oomguard's probe, loaded by its sitecustomize


_record_steps()


# ----- data


def sample(index: int) -> torch.Tensor:
    """Sample ``index`` of the endless random-token corpus (the same whoever asks)."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + index)
    return torch.randint(0, SHAPE.vocab, (SHAPE.seq + 1,), generator=g)


def global_batch(step: int, size: int) -> torch.Tensor:
    """Step ``step``'s batch of ``size`` samples (a plain script draws its data this way)."""
    return torch.stack([sample(step * size + i) for i in range(size)])


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The same corpus as a map-style dataset for the frameworks' data loaders."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": sample(index)}


class MarkedDataset(TokenDataset):
    """The corpus, with a ``data`` record when a framework's loader draws its first sample (the
    restart split's "data" phase; bench/peerkit/restart_hf.py, restart_lightning.py)."""

    drawn = False

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not MarkedDataset.drawn:
            MarkedDataset.drawn = True
            mark("data")
        return super().__getitem__(index)


def micro_batches(batch: torch.Tensor, micro: int) -> Iterator[torch.Tensor]:
    yield from batch.split(micro)
