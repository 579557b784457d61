"""A small training-like worker for the dashboard tests and the load bench.

Above ``OOM_ABOVE`` (micro-batch) it holds some memory for ``OOM_AFTER`` seconds and then dies
with the text PyTorch prints on a CUDA OOM; at or below it, it "trains": a step every ``STEP_S``
seconds, a progress record on the oomguard channel, a checkpoint every ``CKPT_EVERY`` steps,
until ``STEPS`` steps (0: until stopped). Stdlib only, so it starts in milliseconds (with
``CKPT_TORCH`` it imports torch at its first checkpoint, to save it with ``torch.save``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

OOM_TEXT = """Traceback (most recent call last):
  File "train.py", line 212, in <module>
    loss = model(x, y)
  File "torch/nn/modules/module.py", line 1511, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of \
79.10 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.03 GiB memory in use. \
Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.42 GiB is reserved by PyTorch but \
unallocated. If reserved but unallocated memory is large try setting \
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory \
Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def record(kind: str, **fields: object) -> None:
    path = os.environ.get("OOMGUARD_EVENTS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"type": kind, "t": time.time(), **fields}) + "\n")


def save_checkpoint(step: int) -> None:
    folder = Path(os.environ.get("CKPT_DIR", "ckpt"))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".step-{step}.tmp"
    if os.environ.get("CKPT_TORCH"):  # the probe's save record: evidence the script wrote it (observe/checkpoints.py)
        import torch
        torch.save({"step": step}, tmp)
    else:
        tmp.write_bytes(b"x" * 1024)
    os.replace(tmp, folder / f"step-{step}.pt")


def main() -> int:
    micro = int(os.environ["OOMGUARD_MICRO_BATCH"])
    print(f"attempt {os.environ.get('OOMGUARD_ATTEMPT')}: micro-batch {micro}", flush=True)
    hold = bytearray(micro * int(env_float("MB_PER_SAMPLE", 2)) * 1024 * 1024)  # visible in RSS
    if micro > env_float("OOM_ABOVE", 4):
        time.sleep(env_float("OOM_AFTER", 2.5))
        sys.stderr.write(OOM_TEXT)
        return 1
    # Resumes where the supervisor says its checkpoint is, as a script reading the worker protocol does.
    step, steps = int(os.environ.get("OOMGUARD_CHECKPOINT_STEP") or 0), int(env_float("STEPS", 0))
    while steps == 0 or step < steps:
        time.sleep(env_float("STEP_S", 0.2))
        step += 1
        print(f"step {step} loss {1 / step:.4f}", flush=True)
        record("progress", step=step, samples_per_s=micro / env_float("STEP_S", 0.2))
        if step % int(env_float("CKPT_EVERY", 10)) == 0:
            save_checkpoint(step)
    del hold
    return 0


if __name__ == "__main__":
    sys.exit(main())
