"""oomguard's in-process path: the same model trained through ``oomguard.Session``.

As the worker library's README shows it: ``Session(model, optimizer, loss_fn, SessionConfig(...))``
owns the optimizer step; ``session.batches(dataset)`` draws each step's global batch and
``session.step(batch)`` splits it into micro-batches. On an OOM the session frees the step's memory
and redoes the same global batch at the next smaller divisor, in the same process.

    python bench/peerkit/train_session.py --global-batch 64 --steps 20
"""

from __future__ import annotations

import time

STARTED = time.time()


import torch  # noqa: E402
import workload  # noqa: E402

from oomguard import Session, SessionConfig  # noqa: E402

workload.mark("proc", STARTED)
workload.mark("imported")


def main() -> None:
    args = workload.contender_args(__doc__)
    workload.setup()
    dev = workload.device()
    model = workload.TinyGPT().to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    workload.mark("model")
    config = SessionConfig(global_batch=args.global_batch, micro_batch=args.global_batch, total_steps=args.steps)
    dataset = workload.TokenDataset(args.steps * args.global_batch)
    with Session(model, optimizer, lambda m, batch: m(batch["input_ids"].to(dev))["loss"], config) as session:
        for index, batch in enumerate(session.batches(dataset)):
            if index == 0:
                workload.mark("data")
            result = session.step(batch)
            print(f"step {result.step}/{args.steps} micro-batch {result.micro_batch} x {result.grad_accum} "
                  f"loss {result.loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
