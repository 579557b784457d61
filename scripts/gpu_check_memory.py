"""GPU check for the memory watch: real NVML readings of a training process and a real CUDA OOM.

Run on a machine with an NVIDIA GPU and torch built with CUDA:

    .venv/bin/python scripts/gpu_check_memory.py [--capacity-gib G] [--batch 96] [--json OUT.json]

It sizes itself from the GPU it finds: two short uncapped probe runs measure the fixed memory and
the memory per sample, and the simulated capacity leaves room for about 3/8 of the batch.

What it does:

1. Starts a training child (an MLP on CUDA, Adam) capped with
   ``torch.cuda.set_per_process_memory_fraction`` so that only that capacity is usable, at
   micro-batch = the whole per-process batch (96): it hits a real ``torch.OutOfMemoryError``.
2. While each child trains, the parent samples it once a second with ``supervisor.memory.Sampler``
   (real NVML: device total/used/free, utilization, the child's own GPU memory by PID).
3. After each OOM the parent asks ``supervisor.memmodel.shrink_after_oom`` for the next size; after
   a success it asks ``propose_growth`` (as ``--grow`` would). It prints every attempt and the end.

Exit 0 when at least one OOM was provoked and caught, the run ended at a size that trains, and
NVML reported the child's memory by PID (or said in one line why it cannot); 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oomguard.supervisor.observe.sampler import MemorySample, Sampler
from oomguard.supervisor.sizing.memmodel import Point, propose_growth, shrink_after_oom

GIB = 1024**3
PROBE = 4  # micro-batch of the first probe; the second is twice as large


def train_child(micro: int, fraction: float, steps: int) -> int:
    """The worker: trains ``steps`` steps at ``micro`` under a memory fraction; prints JSON lines."""
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    torch.manual_seed(0)
    # ~1.6 GiB fixed (weights, grads, Adam) + ~120 MiB of activations per sample (the parent
    # measures both first and sizes the cap so that about 3/8 of the batch fits).
    width, seq = 4096, 512
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(6)]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    try:
        for step in range(steps):
            x = torch.randn(micro, seq, width, device="cuda")
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_reserved()
            print(json.dumps({"step": step, "loss": float(loss), "peak_reserved": peak}), flush=True)
            time.sleep(0.3)  # leave time for the parent's 1 Hz samples
    except torch.OutOfMemoryError as exc:
        record = {"oom": str(exc).splitlines()[0], "peak_reserved": torch.cuda.max_memory_reserved()}
        print(json.dumps(record), flush=True)
        return 1
    return 0


def run_attempt(micro: int, fraction: float, steps: int, sampler: Sampler) -> dict[str, Any]:
    """One child at ``micro``: its records, its NVML samples and whether it OOMed."""
    cmd = [sys.executable, __file__, "--child", str(micro), "--fraction", str(fraction)]
    cmd += ["--steps", str(steps)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    samples: list[MemorySample] = []
    next_sample = time.monotonic()
    # A thread drains the pipe with blocking reads: a non-blocking text stream's read() can raise
    # (TextIOWrapper over a BufferedReader that returned None), which crashed this parent on an H100.
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(child.stdout or ()), daemon=True)
    reader.start()
    while child.poll() is None:
        if time.monotonic() >= next_sample:
            samples.append(sampler.sample(child.pid))
            next_sample += 1.0
        time.sleep(0.05)
    reader.join(10)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    oom = next((r["oom"] for r in records if "oom" in r), None)
    worker_gpu = [s.worker_gpu_bytes for s in samples if s.worker_gpu_bytes is not None]
    return {
        "micro_batch": micro,
        "returncode": child.returncode,
        "oom": oom,
        "steps": sum(1 for r in records if "step" in r),
        "peak_reserved": max((r.get("peak_reserved", 0) for r in records), default=0),
        "nvml_worker_peak": max(worker_gpu, default=None),
        "nvml_samples": [_brief(s) for s in samples[:3]],
    }


def _brief(sample: MemorySample) -> dict[str, Any]:
    return {
        "gpus": [
            {"name": g.name, "total": g.total_bytes, "used": g.used_bytes, "free": g.free_bytes,
             "util": g.utilization_pct, "worker_bytes": g.worker_bytes, "worker_pids": g.worker_pids,
             "note": g.worker_note}
            for g in sample.gpus
        ],
        "gpu_unavailable": sample.gpu_unavailable,
        "worker_rss": sample.worker_rss_bytes,
    }


def measure(sampler: Sampler) -> tuple[int, int]:
    """(fixed bytes, bytes per sample) of the child's training step, from two uncapped probe runs."""
    peaks = {}
    for micro in (PROBE, 2 * PROBE):
        result = run_attempt(micro, 0.95, 2, sampler)
        if result["oom"] or not result["peak_reserved"]:
            raise SystemExit(f"the probe at micro-batch {micro} did not train: {result['oom'] or result}")
        peaks[micro] = result["peak_reserved"]
    per_sample = max(1, (peaks[2 * PROBE] - peaks[PROBE]) // PROBE)
    return max(0, peaks[PROBE] - per_sample * PROBE), per_sample


def capacity_for(fixed: int, per_sample: int, batch: int, total: int, capacity_gib: float | None) -> int:
    """The usable memory to simulate: room for about 3/8 of the batch, so the full batch and half of
    it OOM and a smaller micro-batch trains, on any GPU from 16 GB to 140 GB."""
    if capacity_gib is not None:
        return int(min(0.95 * total, capacity_gib * GIB))
    return int(min(0.9 * total, fixed + per_sample * batch * 3 // 8 + 512 * 2**20))


def check(capacity_gib: float | None, batch: int, steps: int) -> dict[str, Any]:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    sampler = Sampler()
    fixed, per_sample = measure(sampler)
    capacity = capacity_for(fixed, per_sample, batch, total, capacity_gib)
    fraction = capacity / total
    points: list[Point] = []
    attempts: list[dict[str, Any]] = []
    micro: int | None = batch
    while micro is not None and len(attempts) < 8:
        result = run_attempt(micro, fraction, steps, sampler)
        attempts.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "nvml_samples"}), flush=True)
        peak = result["nvml_worker_peak"] or result["peak_reserved"] or None
        if result["oom"]:
            points.append(Point(micro, capacity, False))
            pick = shrink_after_oom(points, micro, batch, capacity)
        else:
            points.append(Point(micro, peak, result["returncode"] == 0))
            pick = propose_growth(points, micro, batch, capacity)
        micro = pick.micro_batch if pick else None
    sampler.close()
    final = next((a for a in reversed(attempts) if not a["oom"] and a["returncode"] == 0), None)
    return {
        "device": torch.cuda.get_device_name(0),
        "total_bytes": total,
        "fraction": fraction,
        "fixed_bytes": fixed,
        "per_sample_bytes": per_sample,
        "capacity_bytes": capacity,
        "attempts": attempts,
        "ooms": sum(1 for a in attempts if a["oom"]),
        "final_micro_batch": final["micro_batch"] if final else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity-gib", type=float, default=None,
                        help="usable GPU memory to simulate (default: sized from the GPU and the memory "
                             "per sample measured first)")
    parser.add_argument("--batch", type=int, default=96, help="per-process batch (first micro-batch)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per attempt")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return train_child(args.child, args.fraction, args.steps)
    try:
        import torch
    except ImportError:
        print("no torch installed: nothing to check", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device visible: run this on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    result = check(args.capacity_gib, args.batch, args.steps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "attempts"}, indent=2))
    nvml_ok = any(a["nvml_worker_peak"] for a in result["attempts"]) or all(
        s["gpu_unavailable"] for a in result["attempts"] for s in a["nvml_samples"]
    )
    return 0 if result["ooms"] >= 1 and result["final_micro_batch"] and nvml_ok else 1


if __name__ == "__main__":
    sys.exit(main())
