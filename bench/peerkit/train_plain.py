"""A plain training script, the kind ``oomguard run`` supervises unchanged (and the sweep runs).

The sweep of bench/peers.py runs this same file at one fixed size per process, so "the best that
fits" is timed by the same loop, the same records and the same checkpoint writes as ``oomguard-run``
at that size: the two differ only by the supervisor around it.

argparse flags as users write them (``--batch-size``, ``--gradient-accumulation-steps``,
``--resume-from``), ``checkpoint-N/`` directories written atomically, AdamW, each step's global
batch drawn from (seed, step) so it is the same whatever the micro-batch. It knows nothing of
oomguard; the benchmark's records come from the shared model (workload.py).

    python bench/peerkit/train_plain.py --batch-size 16 --gradient-accumulation-steps 4 --steps 20
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: the restart split counts the interpreter and imports

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import workload  # noqa: E402

workload.mark("proc", STARTED)
workload.mark("imported")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, required=True, help="micro-batch size")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--output", type=Path, default=None, help="where checkpoint-N/ go (none: no checkpoints)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume-from", type=Path, default=None)
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step when --batch-size does not divide it (the last micro-batch is shorter); "
                   "default: batch size x accumulation")
    return p.parse_args()


def save(out: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    final, tmp = out / f"checkpoint-{step}", out / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp / "state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def main() -> None:
    args = parse_args()
    workload.setup()
    workload.install_exit_record()
    dev = workload.device()
    model = workload.TinyGPT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    start = 0
    if args.resume_from:
        state = torch.load(args.resume_from / "state.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = json.loads((args.resume_from / "trainer_state.json").read_text())["step"]
    workload.mark("model", step=start)
    size = args.global_batch or args.batch_size * args.gradient_accumulation_steps
    pace = workload.Pace()
    print(f"micro-batch {args.batch_size} x accumulation {args.gradient_accumulation_steps} = {size}", flush=True)
    for step in range(start, args.steps):
        batch = workload.global_batch(step, size).to(dev)
        if step == start:
            workload.mark("data")
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in batch.split(args.batch_size):
            loss = model(chunk)["loss"] * (chunk.shape[0] / size)  # exact accumulation
            loss.backward()
            total += loss.item()
        opt.step()
        pace.step_done()
        print(f"step {step + 1}/{args.steps} loss {total:.4f}", flush=True)
        if args.output and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            save(args.output, step + 1, model, opt)


if __name__ == "__main__":
    main()
