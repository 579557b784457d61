"""The sweep: how fast each micro-batch trains, so "the best that fits" is measured, not assumed.

For each size in ``--sizes`` (ascending) it trains ``--steps`` optimizer steps of ``--global-batch``
samples split into micro-batches of that size (the last one shorter when it does not divide, as
oomguard's Session splits), and records the median step time (data drawing included) after the
first (warm-up) step. It stops at the first size that does not fit (a fresh process then probes
the next size, so an earlier failure's leftovers never decide whether a size fits).

    python bench/peerkit/train_sweep.py --global-batch 64 --sizes 1 2 4 8 16 32 64 --steps 4
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
import workload  # noqa: E402

workload.mark("proc", STARTED)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, micro: int) -> None:
    opt.zero_grad(set_to_none=True)
    for chunk in batch.split(micro):
        (model(chunk)["loss"] * (chunk.shape[0] / batch.shape[0])).backward()
    opt.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--sizes", type=int, nargs="+", required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    workload.setup()
    dev = workload.device()
    model = workload.TinyGPT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for micro in sorted(args.sizes):
        ends = [time.perf_counter()]
        try:
            for step in range(args.steps):
                # Timed from step end to step end, drawing the data included, as the contenders are.
                batch = workload.global_batch(step, args.global_batch).to(dev)
                train(model, opt, batch, micro)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                ends.append(time.perf_counter())
        except RuntimeError as exc:
            if "can't allocate memory" not in str(exc) and "out of memory" not in str(exc):
                raise
            workload.mark("sweep", micro=micro, fits=False)
            print(f"micro-batch {micro}: does not fit", flush=True)
            return
        durations = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        median = statistics.median(durations[1:] or durations)  # the first step warms up
        workload.mark("sweep", micro=micro, fits=True, samples_per_s=args.global_batch / median)
        print(f"micro-batch {micro}: {args.global_batch / median:.1f} samples/s", flush=True)


if __name__ == "__main__":
    main()
