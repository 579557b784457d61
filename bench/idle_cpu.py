"""How much CPU a hung worker uses, and how much a busy one does: the measurement behind the hang
detector's CPU floor (``oomguard/supervisor/observe/progress.py``).

Each scenario is a real process (and its children) started the way oomguard starts a worker; after a
warm-up its process tree's CPU time (user + system, reaped children included) and I/O (bytes read
and written through syscalls) are read every ``--interval`` seconds, as the supervisor's sampler
does. For each scenario it prints the mean and the largest per-interval CPU share of one core, and
the largest per-interval I/O. Hung: blocked on a lock, on a pipe, asleep, a DataLoader whose workers
deadlocked on a lock held across fork, a gloo collective whose peer never comes, an HF Trainer
blocked in a callback. Busy: a training loop (with and without DataLoader workers), a loop that
spins printing nothing.

    .venv/bin/python bench/idle_cpu.py --seconds 20 --interval 1 [--only lock,train]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import psutil

PRELUDE = "import os, sys, time, threading\n"
SCENARIOS: dict[str, str] = {
    # --- hung ---
    "sleep": "time.sleep(3600)",
    "lock": """
import torch
from tqdm import tqdm
bar = tqdm(total=100, file=sys.stdout, mininterval=0.1)  # tqdm's monitor thread, as a training bar has
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's thread pool exists
lock = threading.Lock(); lock.acquire(); lock.acquire()
""",
    "pipe": "r, w = os.pipe(); os.read(r, 1)",
    "dataloader_deadlock": """
import torch
lock = threading.Lock()
class Data(torch.utils.data.Dataset):
    def __len__(self): return 1000
    def __getitem__(self, i):
        with lock:  # held by the parent when the workers forked: never released in them
            return torch.zeros(4)
lock.acquire()
loader = iter(torch.utils.data.DataLoader(Data(), num_workers=2, batch_size=4))
next(loader)
""",
    "gloo_collective": """
import torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=r, world_size=2)
    if r == 0:
        dist.all_reduce(torch.ones(1024))  # rank 1 never joins
    time.sleep(3600)
mp.spawn(rank, nprocs=2)
""",
    "hf_trainer_blocked": """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
lock = threading.Lock()
class Block(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2:
            lock.acquire(); lock.acquire()
class Data(torch.utils.data.Dataset):
    def __len__(self): return 1000
    def __getitem__(self, i):
        ids = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=32, n_layer=1, n_head=2))
args = TrainingArguments(output_dir="/tmp/idle-cpu-hf", max_steps=100, report_to="none", use_cpu=True,
                         per_device_train_batch_size=4, save_strategy="no", logging_steps=1)
Trainer(model=model, args=args, train_dataset=Data(), callbacks=[Block()]).train()
""",
    # --- busy ---
    "train": """
import torch
torch.set_num_threads(1)
net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
opt = torch.optim.AdamW(net.parameters())
x = torch.randn(64, 512)
while True:
    loss = net(x).pow(2).mean(); loss.backward(); opt.step(); opt.zero_grad()
""",
    "train_dataloader": """
import torch
torch.set_num_threads(1)
class Data(torch.utils.data.Dataset):
    def __len__(self): return 10**9
    def __getitem__(self, i): return torch.randn(512)
net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
opt = torch.optim.AdamW(net.parameters())
for x in torch.utils.data.DataLoader(Data(), batch_size=64, num_workers=2):
    loss = net(x).pow(2).mean(); loss.backward(); opt.step(); opt.zero_grad()
""",
    "spin": "while True: pass",
}


def tree_totals(root: psutil.Process) -> tuple[float, int]:
    """(CPU seconds, I/O bytes) of ``root`` and its descendants, reaped children included."""
    cpu, io = 0.0, 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                cpu += t.user + t.system + t.children_user + t.children_system
                counters = proc.io_counters()
                io += counters.read_chars + counters.write_chars
        except psutil.Error:
            continue
    return cpu, io


def measure(name: str, seconds: float, interval: float, warmup: float) -> dict[str, object]:
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + SCENARIOS[name]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(warmup)
        root = psutil.Process(proc.pid)
        shares, ios = [], []
        t0, (cpu0, io0) = time.monotonic(), tree_totals(root)
        start = t0
        while time.monotonic() - start < seconds:
            time.sleep(interval)
            t1, (cpu1, io1) = time.monotonic(), tree_totals(root)
            shares.append(max(0.0, cpu1 - cpu0) / (t1 - t0))
            ios.append(max(0, io1 - io0))
            t0, cpu0, io0 = t1, cpu1, io1
        return {"scenario": name, "interval_s": interval, "samples": len(shares),
                "mean_pct": round(100 * sum(shares) / len(shares), 2), "max_pct": round(100 * max(shares), 2),
                "min_pct": round(100 * min(shares), 2), "max_io_bytes": max(ios)}
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--warmup", type=float, default=12.0, help="seconds to let imports finish and the hang set in")
    p.add_argument("--only", default="", help="comma-separated scenarios")
    args = p.parse_args()
    for name in (args.only.split(",") if args.only else SCENARIOS):
        print(json.dumps(measure(name, args.seconds, args.interval, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
